// Typed errors for the core. Every failure throws one of these with file:line; bindings.cc maps each
// class to a Python exception, so nothing here exits the process or returns a silent status code.
#pragma once

#include <stdexcept>
#include <string>

namespace rocenante {

// Base of every error the core raises.
struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// The caller passed something the communicator cannot serve (dtype, op, size, device, pointer).
struct InvalidArgument : Error {
  using Error::Error;
};
// A peer did not arrive within the timeout; the message names it. The communicator is closed.
struct PeerTimeout : Error {
  using Error::Error;
};
// Ranks called the same collective with different arguments; the message names the peer and both calls.
struct CallMismatch : Error {
  using Error::Error;
};
// A peer aborted the communicator (it faulted, refused a call, was interrupted) or its process ended.
struct PeerAborted : Error {
  using Error::Error;
};
// A signal (Ctrl-C) interrupted a wait for peers; the peers were told. Raised as a KeyboardInterrupt.
struct Interrupted : Error {
  using Error::Error;
};
// The communicator was closed by the user.
struct Closed : Error {
  using Error::Error;
};

[[noreturn]] void throw_system_error(const char* what, const char* file, int line);

}  // namespace rocenante

#define ROCENANTE_STRINGIFY_(x) #x
#define ROCENANTE_STRINGIFY(x) ROCENANTE_STRINGIFY_(x)
#define ROCENANTE_WHERE __FILE__ ":" ROCENANTE_STRINGIFY(__LINE__)

// Throws `Type` with the message and where it was raised, e.g. ROCENANTE_THROW(InvalidArgument, "bad dtype").
// Messages are built from std::string and std::to_string only: std::ostringstream crashed (SIGSEGV) inside
// torch CUDA processes on the GPU machine, so iostreams stay out of the core.
#define ROCENANTE_THROW(Type, msg) throw ::rocenante::Type(std::string(msg) + " [" ROCENANTE_WHERE "]")

// For POSIX calls returning -1 and setting errno.
#define ROCENANTE_CHECK_SYS(call)                                               \
  do {                                                                          \
    if ((call) == -1) ::rocenante::throw_system_error(#call, __FILE__, __LINE__); \
  } while (0)
