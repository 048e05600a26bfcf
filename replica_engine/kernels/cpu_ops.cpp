// The module's bindings: the kernels of every other file, built at first use by
// replica_engine/kernels/cpu.py with -march=native. The one file that includes
// <torch/extension.h> (why the others do not: tensor.h), so they compile beside it.
#include <torch/extension.h>

#include <vector>

#include "cpu_attention.h"
#include "cpu_decoder_layer.h"
#include "cpu_linear.h"
#include "cpu_pointwise.h"
#include "cpu_sampling.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The GIL is released while a kernel runs, as torch's own ops do: the event loop goes on.
  m.def("pack_linear_weight", &pack_linear_weight, "a linear weight in packed_linear's layout");
  m.def("packed_linear", &packed_linear, "x @ weight.T over a packed weight", py::call_guard<py::gil_scoped_release>());
  m.def("packed_moe", &packed_moe, "a mixture's experts: tokens grouped by expert, weighted, summed",
        py::call_guard<py::gil_scoped_release>());
  m.def("quantized_moe", &quantized_moe, "packed_moe over experts kept quantized",
        py::call_guard<py::gil_scoped_release>());
  m.def("quantized_linear", &quantized_linear, "x @ weight.T over a quantized weight",
        py::call_guard<py::gil_scoped_release>());
  m.def("dequantize_rows", &dequantize_rows, "rows of a quantized weight (a token embedding's), dequantized",
        py::call_guard<py::gil_scoped_release>());
  m.def("paged_attention", &paged_attention, "a flat batch's attention over a paged KV cache",
        py::call_guard<py::gil_scoped_release>());
  m.def("decoder_layer", &decoder_layer, "a dense decoder layer's kernels in one call",
        py::call_guard<py::gil_scoped_release>());
  py::class_<DecoderStack>(m, "DecoderStack")
      .def(py::init<std::vector<LayerNorms>, std::vector<std::vector<LayerLinear>>, std::vector<int64_t>, double>())
      .def("forward", &DecoderStack::forward, "every layer's decoder_layer in turn",
           py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, "RMSNorm, after adding x into the residual when one is given",
        py::call_guard<py::gil_scoped_release>());
  m.def("silu_mul", &silu_mul, "silu(gate) * up", py::call_guard<py::gil_scoped_release>());
  m.def("rotary_", &rotary_, "rotate q and k in place", py::call_guard<py::gil_scoped_release>());
  m.def("kept_floor", &kept_floor, "per row, the least likely value its top-k and top-p keep",
        py::call_guard<py::gil_scoped_release>());
  m.def("rotary_store_", &rotary_store_, "rotate q and k in place, store k and v into their cache slots",
        py::call_guard<py::gil_scoped_release>());
}
