// The Python module ampkernels._C: build facts, constants, and the classes the Python package keeps per optimizer
// (GradTable for FusedGradScaler, OptimizerTable for the fused optimizers). The torch.library ops are registered
// apart, one TORCH_LIBRARY_FRAGMENT per op family (scaler/scaler_ops.cpp, matmul/scaled_matmul_ops.cpp).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "common/constants.h"
#include "matmul/scaled_matmul.h"
#include "optim/blockwise_table.h"
#include "optim/optimizer_table.h"
#include "scaler/grad_table.h"

namespace ampkernels {
namespace {

// True when the parameter lists `groups` (a list of lists, as optimizer.param_groups hold them) contain exactly the
// objects of `flat`, in order. Compares object pointers without converting anything: 10k parameters in ~20 us,
// where a Python loop takes ~0.3 ms. Lets FusedGradScaler notice `group["params"][i] = new_param`.
bool same_params(const pybind11::list& groups, const pybind11::tuple& flat) {
  const Py_ssize_t total = PyTuple_GET_SIZE(flat.ptr());
  Py_ssize_t k = 0;
  for (const pybind11::handle group : groups) {
    if (!PyList_Check(group.ptr())) return false;
    const Py_ssize_t n = PyList_GET_SIZE(group.ptr());
    if (k + n > total) return false;
    for (Py_ssize_t i = 0; i < n; ++i, ++k)
      if (PyList_GET_ITEM(group.ptr(), i) != PyTuple_GET_ITEM(flat.ptr(), k)) return false;
  }
  return k == total;
}

// How a hyperparameter field's C++ type appears in the Python dataclass (its annotation).
template <typename T>
const char* field_kind() {
  if constexpr (std::is_same_v<T, bool>)
    return "bool";
  else if constexpr (std::is_floating_point_v<T>)
    return "float";
  else
    return "int";
}

// Field `name` of a hyperparameters object (ampkernels/optim/hyperparameters.py) as a T.
template <typename T>
T hyperparameter(pybind11::handle src, const char* name) {
  pybind11::object value;
  try {
    value = src.attr(name);
    return value.cast<T>();
  } catch (const pybind11::error_already_set& e) {
    if (!e.matches(PyExc_AttributeError)) throw;
  } catch (const pybind11::cast_error&) {
  }
  throw pybind11::type_error(message("ampkernels: argument 'hyper': expected a dataclass of ",
                                     "ampkernels.optim.hyperparameters with the ", field_kind<T>(), " field '", name,
                                     "', got ", pybind11::repr(value ? value : src).cast<std::string>()));
}

}  // namespace
}  // namespace ampkernels

// AdamHyperparameters and SgdHyperparameters from the Python dataclasses of the same names, read field by field
// (optimizer.h lists the fields): converted once per bucket and step, where the step enters C++.
#define AMPK_READ_FIELD(type, name) value.name = ampkernels::hyperparameter<type>(src, #name);
#define AMPK_WRITE_FIELD(type, name) out[#name] = h.name;
#define AMPK_HYPERPARAMETERS_CASTER(Type, FIELDS)                                                  \
  template <>                                                                                      \
  struct type_caster<ampkernels::Type> {                                                           \
    PYBIND11_TYPE_CASTER(ampkernels::Type, const_name(#Type));                                     \
    bool load(handle src, bool) {                                                                  \
      FIELDS(AMPK_READ_FIELD)                                                                      \
      return true;                                                                                 \
    }                                                                                              \
    static handle cast(const ampkernels::Type& h, return_value_policy, handle) {                   \
      dict out;                                                                                    \
      FIELDS(AMPK_WRITE_FIELD)                                                                     \
      return out.release();                                                                        \
    }                                                                                              \
  };
namespace pybind11 {
namespace detail {
AMPK_HYPERPARAMETERS_CASTER(AdamHyperparameters, AMPK_ADAM_HYPERPARAMETERS)
AMPK_HYPERPARAMETERS_CASTER(SgdHyperparameters, AMPK_SGD_HYPERPARAMETERS)
}  // namespace detail
}  // namespace pybind11
#undef AMPK_HYPERPARAMETERS_CASTER
#undef AMPK_WRITE_FIELD
#undef AMPK_READ_FIELD

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ampkernels native extension: CPU kernels always, CUDA kernels when built with a CUDA toolkit";
#ifdef AMPK_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
  m.attr("cuda_arch_list") = AMPK_CUDA_ARCH_LIST;
  m.attr("wgmma_built") = ampkernels::scaled_matmul_wgmma_built();
  m.def(
      "wgmma_schedule",
      [](int64_t M, int64_t N, int64_t sms) {
        const ampkernels::WgmmaSchedule s = ampkernels::scaled_matmul_wgmma_schedule(M, N, sms);
        return pybind11::make_tuple(s.bn, s.grid);
      },
      "(tile width, grid) of the wgmma kernel for an M x N output on `sms` SMs", pybind11::arg("M"), pybind11::arg("N"),
      pybind11::arg("sms"));
  // The configurations forced for the probes and tests (scaled_matmul.h); Python sets them from the attributes of
  // ampkernels.matmul.tuning (its apply()).
  m.def("_set_matmul_tuning", &ampkernels::set_matmul_tuning,
        "force the WMMA kernel's configuration ('auto': its own choice) and the wgmma kernels' tile width (0: their "
        "own choice)",
        pybind11::arg("wmma_tile"), pybind11::arg("wgmma_bn"));
  m.def(
      "_matmul_tuning",
      [] {
        return pybind11::make_tuple(ampkernels::wmma_tile_name(ampkernels::forced_wmma_tile()),
                                    ampkernels::forced_wgmma_bn());
      },
      "(WMMA configuration, wgmma tile width) as _set_matmul_tuning last set them");
  m.attr("chunk_size") = ampkernels::kChunkSize;
  m.attr("norm_none") = static_cast<int>(ampkernels::NormKind::kNone);
  m.attr("norm_l2") = static_cast<int>(ampkernels::NormKind::kL2);
  m.attr("norm_inf") = static_cast<int>(ampkernels::NormKind::kInf);
  m.attr("no_clip") = ampkernels::kNoClip;
  // Threads that at::parallel_for runs `tasks` tasks of one item on here (1 when the extension was built without
  // intra-op parallelism: at::parallel_for is inline, so it depends on how this file was compiled, not on torch).
  m.def(
      "parallel_for_threads",
      [](int64_t tasks) {
        std::mutex mutex;
        std::set<int> seen;
        at::parallel_for(0, tasks, 1, [&](int64_t, int64_t) {
          const std::lock_guard<std::mutex> lock(mutex);
          seen.insert(at::get_thread_num());
        });
        return static_cast<int64_t>(seen.size());
      },
      pybind11::arg("tasks"));
  m.def("same_params", &ampkernels::same_params, pybind11::arg("groups"), pybind11::arg("flat"));
  pybind11::class_<ampkernels::GradTable>(m, "GradTable")
      .def(pybind11::init([](std::vector<at::Tensor> params, const std::string& device) {
             return std::make_unique<ampkernels::GradTable>(std::move(params), at::Device(device));
           }),
           pybind11::arg("params"), pybind11::arg("device"))
      .def("refresh", &ampkernels::GradTable::refresh)
      .def("unscale_reduce", &ampkernels::GradTable::unscale_reduce, pybind11::arg("scale"),
           pybind11::arg("found_inf"), pybind11::arg("factor"), pybind11::arg("write"), pybind11::arg("norm_kind"),
           pybind11::arg("per_tensor"), pybind11::arg("max_norm"), pybind11::arg("revalidate") = true)
      .def("sparse_params", &ampkernels::GradTable::sparse_params)
      .def_property_readonly("rebuilds", &ampkernels::GradTable::rebuilds)
      .def("addresses", &ampkernels::GradTable::addresses);
  // (name, kind) of each field of the hyperparameter structs (optimizer.h), for the test that compares them with
  // the Python dataclasses.
#define AMPK_FIELD_ENTRY(type, name) fields.append(pybind11::make_tuple(#name, ampkernels::field_kind<type>()));
  {
    pybind11::list fields;
    AMPK_ADAM_HYPERPARAMETERS(AMPK_FIELD_ENTRY)
    m.attr("adam_hyperparameter_fields") = pybind11::tuple(fields);
  }
  {
    pybind11::list fields;
    AMPK_SGD_HYPERPARAMETERS(AMPK_FIELD_ENTRY)
    m.attr("sgd_hyperparameter_fields") = pybind11::tuple(fields);
  }
#undef AMPK_FIELD_ENTRY
  pybind11::class_<ampkernels::OptimizerTable>(m, "OptimizerTable")
      .def(pybind11::init([](const std::string& kind, std::vector<at::Tensor> params,
                             std::vector<std::vector<at::Tensor>> state, std::vector<at::Tensor> watch,
                             at::ScalarType grad_dtype) {
             return std::make_unique<ampkernels::OptimizerTable>(ampkernels::kind_of(kind), std::move(params), std::move(state),
                                                     std::move(watch), grad_dtype);
           }),
           pybind11::arg("kind"), pybind11::arg("params"), pybind11::arg("state"), pybind11::arg("watch"),
           pybind11::arg("grad_dtype"))
      .def("refresh", &ampkernels::OptimizerTable::refresh)
      .def("step_adam", &ampkernels::OptimizerTable::step_adam, pybind11::arg("lr"), pybind11::arg("lr_tensor"),
           pybind11::arg("hyper"), pybind11::arg("grad_scale"), pybind11::arg("found_inf"))
      .def("step_sgd", &ampkernels::OptimizerTable::step_sgd, pybind11::arg("lr"), pybind11::arg("lr_tensor"),
           pybind11::arg("hyper"), pybind11::arg("grad_scale"), pybind11::arg("found_inf"))
      .def_property_readonly("uploads", &ampkernels::OptimizerTable::uploads)
      .def("addresses", &ampkernels::OptimizerTable::addresses);

  pybind11::class_<ampkernels::BlockwiseAdamTable>(m, "BlockwiseAdamTable")
      .def(pybind11::init<std::vector<at::Tensor>, std::vector<std::vector<at::Tensor>>,
                          std::vector<ampkernels::BlockwiseAdamTable::Layout>, std::vector<at::Tensor>,
                          at::ScalarType>(),
           pybind11::arg("params"), pybind11::arg("state"), pybind11::arg("layout"), pybind11::arg("watch"),
           pybind11::arg("grad_dtype"))
      .def("refresh", &ampkernels::BlockwiseAdamTable::refresh)
      .def("step_adam", &ampkernels::BlockwiseAdamTable::step_adam, pybind11::arg("lr"), pybind11::arg("lr_tensor"),
           pybind11::arg("hyper"), pybind11::arg("grad_scale"), pybind11::arg("found_inf"))
      .def_property_readonly("uploads", &ampkernels::BlockwiseAdamTable::uploads)
      .def("addresses", &ampkernels::BlockwiseAdamTable::addresses);
}
