// kvbank._kvbank.Fleet (python/src/fleet.cc): the fleet's bindings, registered by module.cc.
#ifndef KVBANK_PYTHON_SRC_FLEET_H_
#define KVBANK_PYTHON_SRC_FLEET_H_

#include <pybind11/pybind11.h>

namespace kvbank::python {

// Adds class Fleet to the extension module `m`.
void BindFleet(pybind11::module_& m);

}  // namespace kvbank::python

#endif  // KVBANK_PYTHON_SRC_FLEET_H_
