// ckptd._native.plan_read: the read planner (format/read_plan.h) over files that are not a
// ckptd step (a Hugging Face folder), so that their tensors reshard onto a rank's placement
// as a step's do. Bindings only; the planning is format's.
#pragma once

#include <pybind11/pybind11.h>

namespace ckpt::python {

void DefinePlanRead(pybind11::module_& m);

}  // namespace ckpt::python
