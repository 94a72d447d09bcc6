#include "kvroute/version.hpp"

namespace kvroute {

const char* version() noexcept { return "0.1.0"; }

}  // namespace kvroute
