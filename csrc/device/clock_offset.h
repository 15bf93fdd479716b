// Timeline builds (csrc/timeline.h): %globaltimer minus CLOCK_REALTIME on `device`, in nanoseconds, from the
// fastest of many GPU-host round trips through mapped memory (clock_offset.cu).
#pragma once

#include <cstdint>

namespace rocenante {

int64_t measure_clock_offset_ns(int device);

}  // namespace rocenante
