// aidaptiv_ds.engine._C: the Python API of the engine, declared. The logic lives in csrc/src; the Python face
// (lifetimes, settings, documentation) in aidaptiv_ds/engine/io.py. Everything that can block releases the GIL.
#include <pybind11/stl.h>
#include <torch/extension.h>

#include "aidaptiv/detail/test_hooks.hpp"
#include "aidaptiv/engine.hpp"
#include "aidaptiv/error.hpp"
#include "aidaptiv/pinned_pool.hpp"
#include "aidaptiv/weight_codec.hpp"

namespace py = pybind11;
using namespace aidaptiv;
using release_gil = py::call_guard<py::gil_scoped_release>;

PYBIND11_MODULE(_C, m) {
  m.doc() = "aidaptiv-ds I/O engine: io_uring / POSIX O_DIRECT reads and writes, pinned pool";

  // SystemError -> OSError(errno, message, filename): Python picks FileNotFoundError, PermissionError,
  // ... from the errno. InvalidArgument -> ValueError, OutOfPinnedMemory -> MemoryError.
  // Module-local: pybind11 >= 3 shares its global translator list with every extension built against the
  // same internals (torch's, DeepSpeed's JIT ops), so a global one would be tried for their exceptions and
  // theirs for ours; a local one is tried first for exceptions thrown by this module's functions only.
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const SystemError& e) {
      py::object filename = e.path().empty() ? py::none() : py::object(py::str(e.path()));
      py::object exc = py::handle(PyExc_OSError)(e.error_code(), e.what(), filename);
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    } catch (const InvalidArgument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const OutOfPinnedMemory& e) {
      PyErr_SetString(PyExc_MemoryError, e.what());
    } catch (const Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    } catch (const std::bad_alloc& e) {
      PyErr_SetString(PyExc_MemoryError, e.what());
    } catch (const c10::Error& e) {
      // torch's own (a tensor check in a binding): its message without the C++ backtrace, as torch raises it.
      PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
    } catch (const std::exception& e) {
      // Anything else this module's functions can throw (the standard library's). Caught here so that no other
      // module's translator in pybind11's shared list is ever asked to translate an exception of ours: one
      // built against other internals can crash on it (the H100's SIGSEGV, ../shared/gpu-probe).
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });

  m.attr("ALIGNMENT") = kAlignment;
  // What this build was compiled with, checked against torch at import (aidaptiv_ds/engine/io.py): a different
  // libstdc++ string ABI would pass std::string and c10::Error across the boundary with another layout.
  m.attr("GLIBCXX_USE_CXX11_ABI") = bool(_GLIBCXX_USE_CXX11_ABI);
#if defined(__clang__)
  m.attr("COMPILER") = std::string("Clang ") + __clang_version__;
#else
  m.attr("COMPILER") = std::string("GCC ") + __VERSION__;
#endif
#ifdef AIDAPTIV_WITH_CUDA
  m.attr("WITH_CUDA") = true;
#else
  m.attr("WITH_CUDA") = false;
#endif

  py::class_<PoolStats>(m, "PoolStats")
      .def_readonly("capacity", &PoolStats::capacity)
      .def_readonly("in_use", &PoolStats::in_use)
      .def_readonly("high_water", &PoolStats::high_water)
      .def_readonly("blocks", &PoolStats::blocks)
      .def_readonly("largest_free", &PoolStats::largest_free)
      .def_readonly("locked", &PoolStats::locked)
      .def_readonly("lock_method", &PoolStats::lock_method)
      .def_readonly("lock_note", &PoolStats::lock_note);

  py::class_<PinnedPool, std::shared_ptr<PinnedPool>>(m, "PinnedPool")
      .def(py::init(&PinnedPool::create), py::arg("capacity_bytes"), release_gil())
      .def("allocate", &PinnedPool::allocate, py::arg("numel"), py::arg("dtype"), py::arg("from_top") = false,
           release_gil())
      .def("try_allocate", &PinnedPool::try_allocate, py::arg("numel"), py::arg("dtype"),
           py::arg("from_top") = false, release_gil())
      .def("contains", &PinnedPool::contains, py::arg("address"), py::arg("nbytes"))
      .def("stats", &PinnedPool::stats)
      .def_property_readonly("address", [](const PinnedPool& p) { return reinterpret_cast<uintptr_t>(p.base()); })
      .def_property_readonly("capacity", &PinnedPool::capacity);

  py::enum_<BackendKind>(m, "BackendKind")
      .value("IO_URING", BackendKind::IoUring)
      .value("POSIX", BackendKind::Posix)
      .value("AUTO", BackendKind::Auto);

  py::class_<EngineOptions>(m, "EngineOptions")
      .def(py::init<>())
      .def_readwrite("backend", &EngineOptions::backend)
      .def_readwrite("block_size", &EngineOptions::block_size)
      .def_readwrite("queue_depth", &EngineOptions::queue_depth)
      .def_readwrite("threads", &EngineOptions::threads)
      .def_readwrite("sqpoll", &EngineOptions::sqpoll);

  py::class_<EngineStats>(m, "EngineStats")
      .def_readonly("bytes_read", &EngineStats::bytes_read)
      .def_readonly("bytes_written", &EngineStats::bytes_written)
      .def_readonly("reads", &EngineStats::reads)
      .def_readonly("writes", &EngineStats::writes)
      .def_readonly("errors", &EngineStats::errors)
      .def_readonly("in_flight", &EngineStats::in_flight)
      .def_readonly("wait_seconds", &EngineStats::wait_seconds)
      .def_readonly("direct_fallbacks", &EngineStats::direct_fallbacks);

  // Fault injection for the test suite only (see detail/test_hooks.hpp); process-wide, so tests arm
  // them in a child process. Never call these in a job.
  m.def("_testing_fail_next_submits", &aidaptiv::detail::testing::fail_next_submits, py::arg("errno"),
        py::arg("count") = 1, "TEST HOOK: the next `count` io_uring submissions fail with errno.");
  m.def(
      "_testing_throw",
      [](const std::string& kind) {
        if (kind == "system") throw SystemError(ENOENT, "/nonexistent/aidaptiv", "open failed: ENOENT (test)");
        if (kind == "invalid") throw InvalidArgument("invalid argument (test)");
        if (kind == "pinned") throw OutOfPinnedMemory("out of pinned memory (test)");
        if (kind == "error") throw Error("engine error (test)");
        if (kind == "bad_alloc") throw std::bad_alloc();
        if (kind == "c10") TORCH_CHECK(false, "torch check failed (test)");
        if (kind == "std") throw std::out_of_range("standard library error (test)");
        throw InvalidArgument("_testing_throw: unknown kind " + kind);
      },
      py::arg("kind"), "TEST HOOK: throw one exception of the given kind from C++ (the translator's test).");
  m.def("_testing_throw_in_next_completions", &aidaptiv::detail::testing::throw_in_next_completions, py::arg("count") = 1,
        "TEST HOOK: the next `count` completion checks (io_uring reaper, POSIX workers) throw std::bad_alloc.");

  m.def("decode_weights", &decode_weights_into, py::arg("encoded"), py::arg("n"), py::arg("itemsize"),
        py::arg("table"), py::arg("escape_positions"), py::arg("escape_values"), py::arg("out"), release_gil(),
        "Rebuild n floating-point elements into out from their encoded planes and codes "
        "(aidaptiv/weight_codec.hpp; aidaptiv_ds/inference/weight_codec.py).");

  py::class_<Engine>(m, "Engine")
      .def(py::init<const EngineOptions&, std::shared_ptr<PinnedPool>>(), py::arg("options"),
           py::arg("pool") = nullptr, release_gil())
      .def_property_readonly("backend", &Engine::backend)
      .def_property_readonly("backend_name", &Engine::backend_name)
      .def_property_readonly("fallback_reason", &Engine::fallback_reason)
      .def_property_readonly("fixed_buffers", &Engine::fixed_buffers)
      .def_property_readonly("fixed_buffers_note", &Engine::fixed_buffers_note)
      .def_property_readonly("setup_note", &Engine::setup_note)
      .def("open", &Engine::open, py::arg("path"), py::arg("create") = false, py::arg("exclusive") = false,
           release_gil())
      .def("close", &Engine::close, py::arg("file_id"), release_gil())
      .def("read_async", &Engine::read_async, py::arg("buffer"), py::arg("file"), py::arg("offset") = 0,
           release_gil())
      .def("write_async", &Engine::write_async, py::arg("buffer"), py::arg("file"), py::arg("offset") = 0,
           release_gil())
      .def("wait", &Engine::wait, py::arg("handle"), release_gil())
      .def("poll", &Engine::poll, py::arg("handle"))
      .def("wait_all", &Engine::wait_all, release_gil())
      .def("shutdown", &Engine::shutdown, release_gil())
#ifdef AIDAPTIV_WITH_CUDA
      .def("read_to_device", &Engine::read_to_device, py::arg("dst"), py::arg("file"), py::arg("offset"),
           py::arg("staging"), release_gil())
      .def("write_from_device", &Engine::write_from_device, py::arg("src"), py::arg("file"), py::arg("offset"),
           py::arg("staging"), release_gil())
#endif
      .def("stats", &Engine::stats);
}
