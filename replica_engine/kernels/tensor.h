// The slice of ATen the kernels use: tensors, their dtypes and the few factories they call.
// Not <torch/extension.h> (pybind and the whole op set): that header alone took ~28 s to compile
// per file here; only the bindings (cpu_ops.cpp) include it.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
