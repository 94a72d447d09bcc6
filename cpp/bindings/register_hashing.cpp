#include "register.hpp"

namespace kvroute::bindings {

void register_hashing(pybind11::module_& m) { (void)m; }

}  // namespace kvroute::bindings
