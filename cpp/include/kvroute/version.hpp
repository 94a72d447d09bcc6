#pragma once

namespace kvroute {

/// The core library's version string.
const char* version() noexcept;

}  // namespace kvroute
