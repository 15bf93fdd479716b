#include "errors.h"

#include <cerrno>
#include <cstring>

namespace rocenante {

void throw_system_error(const char* what, const char* file, int line) {
  const int err = errno;
  throw Error(std::string(what) + " failed: " + std::strerror(err) + " [" + file + ":" + std::to_string(line) + "]");
}

}  // namespace rocenante
