// pybind11 module rocenante._C: the Communicator, its enums, and one Python exception per error class.
// Calls that may wait on peers release the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <tuple>

#include "communicator.h"
#include "errors.h"
#include "transport/transport.h"

namespace py = pybind11;
using rocenante::Communicator;

namespace {

// For host waits (the CPU path), which run without the GIL: takes it briefly and asks whether a signal
// handler raised (Ctrl-C). The KeyboardInterrupt is dropped here; the core raises Interrupted instead.
bool python_signal_pending() {
  py::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() == 0) return false;
  PyErr_Clear();
  return true;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "rocenante core: all-reduce, all-gather and reduce-scatter over shared memory, CUDA IPC and the network";

  auto base = py::register_exception<rocenante::Error>(m, "RocenanteError", PyExc_RuntimeError);
  py::register_exception<rocenante::InvalidArgument>(m, "InvalidArgument", PyExc_ValueError);
  py::register_exception<rocenante::PeerTimeout>(m, "PeerTimeoutError", base.ptr());
  py::register_exception<rocenante::CallMismatch>(m, "CallMismatchError", base.ptr());
  py::register_exception<rocenante::PeerAborted>(m, "PeerAbortedError", base.ptr());
  py::register_exception<rocenante::Interrupted>(m, "Interrupted", PyExc_KeyboardInterrupt);
  py::register_exception<rocenante::Closed>(m, "ClosedError", base.ptr());

  py::enum_<rocenante::DType>(m, "DType")
      .value("float32", rocenante::DType::kFloat32)
      .value("float16", rocenante::DType::kFloat16)
      .value("bfloat16", rocenante::DType::kBFloat16)
      .value("int32", rocenante::DType::kInt32);
  py::enum_<rocenante::ReduceOp>(m, "ReduceOp")
      .value("sum", rocenante::ReduceOp::kSum)
      .value("avg", rocenante::ReduceOp::kAvg)
      .value("max", rocenante::ReduceOp::kMax)
      .value("min", rocenante::ReduceOp::kMin);

  py::enum_<rocenante::Net>(m, "Net")
      .value("shm", rocenante::Net::kShm)
      .value("ib", rocenante::Net::kIb)
      .value("tcp", rocenante::Net::kTcp);
  py::enum_<rocenante::OnFault>(m, "OnFault")
      .value("raise_", rocenante::OnFault::kRaise)
      .value("abort", rocenante::OnFault::kAbort);
  py::enum_<rocenante::Signal>(m, "Signal", "how a network peer's delivery tells the reducer it is whole")
      .value("flag", rocenante::Signal::kFlag)
      .value("completion", rocenante::Signal::kCompletion)
      .value("flag_first", rocenante::Signal::kFlagFirst);
  Communicator::set_interrupt_check(python_signal_pending);
  m.def("_test_stop_after_push", &rocenante::stop_after_push, py::arg("push"), py::arg("kill"),
        "tests only: stop (SIGSTOP) or end (SIGKILL) this process right after its push-th CPU call's push");
  m.def(
      "_test_wire_block_bytes",
      [](size_t region_bytes, size_t extra_bytes, size_t page_bytes) {
        return page_bytes == 0 ? rocenante::WireBlock(region_bytes, extra_bytes).bytes()
                               : rocenante::WireBlock(region_bytes, extra_bytes, page_bytes).bytes();
      },
      py::arg("region_bytes"), py::arg("extra_bytes"), py::arg("page_bytes"),
      "tests only: the bytes a network wire maps for these sizes with this page size (0: the host's)");
  m.def("_test_skip_goodbyes", &rocenante::Communicator::skip_goodbyes, py::arg("skip"),
        "tests only: close() sends no goodbye from now on, as a host that vanished");
  m.def(
      "_test_fault_record_race",
      [](int device) {
        using rocenante::Fault;
        const uint32_t epoch = 7;
        const uint64_t first = rocenante::encode_fault(Fault::kPeerTimeout, 0b10, 0);
        const uint64_t second = rocenante::encode_fault(Fault::kCallMismatch, 1, 0x1234);
        std::vector<rocenante::FaultRecord> records;
        {
          py::gil_scoped_release unlocked;
          records = rocenante::test_fault_record_race(device, first, second, epoch);
        }
        std::vector<std::pair<uint64_t, uint32_t>> reads;
        for (const auto& r : records) reads.emplace_back(r.word, r.epoch);
        return py::make_tuple(py::make_tuple(py::make_tuple(first, epoch), py::make_tuple(second, epoch + 1)), reads);
      },
      py::arg("device"),
      "tests only: two threads of a launch record two calls' faults at once, each holding the record half written "
      "for milliseconds, while the host reads it: ((first, epoch), (second, epoch + 1)) and every record read");

#ifdef ROCENANTE_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
  m.attr("max_ranks") = rocenante::kMaxRanks;
  m.attr("max_capacity_bytes") = rocenante::kMaxCapacityBytes;
  m.attr("capacity_granule_bytes") = rocenante::kCapacityGranule;
  m.attr("max_timeout_s") = Communicator::kMaxTimeoutS;
  m.attr("default_proxy_spin_s") = rocenante::kDefaultProxySpinS;
  m.attr("max_proxy_spin_s") = rocenante::kMaxProxySpinS;
  m.attr("timeline_build") = rocenante::kTimeline;  // built with -DROCENANTE_TIMELINE=ON (csrc/timeline.h)
  m.attr("with_ibverbs") = rocenante::kWithIbverbs;

  // The wire format of layout.h, for tests that play a peer by writing a region by hand.
  auto layout = m.def_submodule("layout", "offsets and words of csrc/layout.h");
  layout.attr("header_bytes") = rocenante::kHeaderBytes;
  layout.attr("empty") = rocenante::kEmpty;
  layout.def("buffer_of", &rocenante::buffer_of, py::arg("epoch"));
  layout.def("call_word_offset", [](int buffer, int source) {
    uint32_t header[rocenante::kHeaderBytes / sizeof(uint32_t)];
    return size_t(rocenante::call_word(header, buffer, source) - header) * sizeof(uint32_t);
  }, py::arg("buffer"), py::arg("source"));
  layout.def("arrival_flag_offset", &rocenante::arrival_flag_offset, py::arg("buffer"), py::arg("source"));
  layout.attr("no_epoch") = rocenante::kNoEpoch;
  layout.def("area_offset", [](size_t capacity_bytes, int world, int buffer, int receiver, int source) {
    return rocenante::RegionLayout{capacity_bytes, world}.area_offset(buffer, receiver, source);
  }, py::arg("capacity_bytes"), py::arg("world"), py::arg("buffer"), py::arg("receiver"), py::arg("source"));
  py::enum_<rocenante::Collective>(layout, "Collective")
      .value("all_reduce", rocenante::Collective::kAllReduce)
      .value("fused_all_reduce", rocenante::Collective::kFusedAllReduce)
      .value("all_gather", rocenante::Collective::kAllGather)
      .value("reduce_scatter", rocenante::Collective::kReduceScatter)
      .value("all_to_all", rocenante::Collective::kAllToAll)
      .value("all_to_all_v", rocenante::Collective::kAllToAllV);
  layout.def("call_word", [](size_t count, rocenante::DType dtype, rocenante::ReduceOp op, uint32_t epoch,
                             rocenante::Collective collective, bool two_shot) {
    const auto algorithm = two_shot ? rocenante::Algorithm::kTwoShot : rocenante::Algorithm::kOneShot;
    return rocenante::make_flag(rocenante::call_signature(count, dtype, op, collective, algorithm), epoch);
  }, py::arg("count"), py::arg("dtype"), py::arg("op"), py::arg("epoch"),
     py::arg("collective") = rocenante::Collective::kAllReduce, py::arg("two_shot") = false);
  layout.attr("never") = Communicator::kNever;
  layout.def("chunk_line", &rocenante::chunk_line, py::arg("chunk"), py::arg("half"));
  layout.attr("buffers") = rocenante::kBuffers;
  layout.attr("max_rails") = rocenante::kMaxRails;
  layout.attr("epoch_period") = rocenante::kEpochPeriod;
  // The handles' formats (communicator.h, transport.h), for tests that forge or tamper with one.
  layout.attr("config_magic") = rocenante::kConfigMagic;
  layout.attr("config_bytes") = rocenante::kConfigBytes;
  layout.attr("handle_header_bytes") = rocenante::kHandleHeaderBytes;
  layout.attr("tcp_handle_magic") = rocenante::kTcpHandleMagic;
  layout.attr("tcp_hello_magic") = rocenante::kTcpHelloMagic;
  layout.attr("rdma_handle_magic") = rocenante::kRdmaHandleMagic;

  py::class_<Communicator>(m, "Communicator")
      .def(py::init([](int rank, int world, int device, size_t capacity_bytes, double timeout_s,
                       rocenante::OnFault on_fault, rocenante::Net net,
                       const std::vector<std::vector<std::tuple<std::string, int, int, int, int>>>& rdma_paths,
                       uint32_t first_call, double proxy_spin_s, rocenante::Signal signal, uint32_t twoshot_from) {
             std::vector<std::vector<rocenante::IbPath>> paths;
             for (const auto& rails : rdma_paths) {
               paths.emplace_back();
               for (const auto& [dev, port, gid, tc, sl] : rails) paths.back().push_back({dev, port, gid, tc, sl});
             }
             return new Communicator(rank, world, device, capacity_bytes, timeout_s, on_fault, net, paths, first_call,
                                     proxy_spin_s, signal, twoshot_from);
           }),
           py::arg("rank"), py::arg("world"), py::arg("device"), py::arg("capacity_bytes"), py::arg("timeout_s"),
           py::arg("on_fault"), py::arg("net") = rocenante::Net::kShm,
           py::arg("rdma_paths") = std::vector<std::vector<std::tuple<std::string, int, int, int, int>>>{},
           py::arg("first_call") = 1,
           py::arg("proxy_spin_s") = rocenante::kDefaultProxySpinS, py::arg("signal") = rocenante::Signal::kFlag,
           py::arg("twoshot_from") = Communicator::kNever)
      .def("local_handle", [](const Communicator& c) { return py::bytes(c.local_handle()); })
      // Over the TCP wire connecting waits for the peers (up to 30 s): other Python threads keep running.
      .def("connect", &Communicator::connect, py::arg("handles"), py::call_guard<py::gil_scoped_release>())
      .def("all_connected", &Communicator::all_connected)
      .def("all_reduce", &Communicator::all_reduce, py::arg("inp"), py::arg("out"), py::arg("count"), py::arg("dtype"),
           py::arg("op"), py::arg("stream"), py::call_guard<py::gil_scoped_release>())
      .def("all_gather", &Communicator::all_gather, py::arg("inp"), py::arg("out"), py::arg("count"), py::arg("dtype"),
           py::arg("stream"), py::call_guard<py::gil_scoped_release>())
      .def("reduce_scatter", &Communicator::reduce_scatter, py::arg("inp"), py::arg("out"), py::arg("count"),
           py::arg("dtype"), py::arg("op"), py::arg("stream"), py::call_guard<py::gil_scoped_release>())
      .def("all_to_all", &Communicator::all_to_all, py::arg("inp"), py::arg("out"), py::arg("count"), py::arg("dtype"),
           py::arg("stream"), py::call_guard<py::gil_scoped_release>())
      .def("all_to_all_v", &Communicator::all_to_all_v, py::arg("inp"), py::arg("out"), py::arg("dtype"),
           py::arg("send"), py::arg("recv"), py::arg("stream"), py::call_guard<py::gil_scoped_release>())
      .def("all_to_all_v_counts", &Communicator::all_to_all_v_counts, py::arg("inp"), py::arg("out"), py::arg("dtype"),
           py::arg("send_counts"), py::arg("recv_counts"), py::arg("row"), py::arg("in_rows"),
           py::arg("capacity_rows"), py::arg("stream"), py::call_guard<py::gil_scoped_release>())
      .def("largest_block", [](const Communicator& c, rocenante::DType dtype) {
             return rocenante::largest_block(c.capacity_bytes(), c.world(), dtype);
           }, py::arg("dtype"))
      .def("two_shot", [](const Communicator& c, size_t bytes) {
             return c.algorithm_for(bytes) == rocenante::Algorithm::kTwoShot;
           }, py::arg("bytes"))
      .def_property_readonly("twoshot_from", &Communicator::twoshot_from_bytes)
      .def("fuses_add_rmsnorm", &Communicator::fuses_add_rmsnorm, py::arg("count"), py::arg("hidden"), py::arg("dtype"))
      .def("all_reduce_add_rmsnorm", &Communicator::all_reduce_add_rmsnorm, py::arg("inp"), py::arg("residual_in"),
           py::arg("gamma"), py::arg("residual_out"), py::arg("norm_out"), py::arg("count"), py::arg("hidden"),
           py::arg("dtype"), py::arg("eps"), py::arg("weight_bias"), py::arg("stream"),
           py::call_guard<py::gil_scoped_release>())
      .def("refuse", &Communicator::refuse, py::arg("why"), py::call_guard<py::gil_scoped_release>())
      .def("_test_post_aborts_at_once", &Communicator::test_post_aborts_at_once, py::arg("hold_s"),
           py::call_guard<py::gil_scoped_release>())
      .def("check", &Communicator::check)  // reads a few words (waits only for a close() under way)
      .def("faulted_by", &Communicator::faulted_by, py::arg("call"))
      .def_property_readonly("captured", &Communicator::captured)
      .def("stream_done", &Communicator::stream_done, py::arg("stream"))
      .def("close", &Communicator::close, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("closed", &Communicator::closed)
      .def_property_readonly("rank", &Communicator::rank)
      .def_property_readonly("world", &Communicator::world)
      .def_property_readonly("device", &Communicator::device)
      .def_property_readonly("capacity_bytes", &Communicator::capacity_bytes)
      .def_property_readonly("timeout_s", &Communicator::timeout_s)
#ifdef ROCENANTE_TIMELINE
      // Every slot's events, [slot][event] in nanoseconds (csrc/timeline.h), and the GPU-host clock offset.
      .def("timeline", [](const Communicator& c) {
             const rocenante::Timeline& t = c.timeline();
             std::vector<std::vector<uint64_t>> slots(rocenante::kTimelineSlots);
             for (uint32_t i = 0; i < uint32_t(rocenante::kTimelineSlots); ++i)
               for (int e = 0; e < rocenante::kTimelineEvents; ++e) slots[i].push_back(*rocenante::timeline_entry(&t, i, e));
             return slots;
           })
      .def("clock_offset_ns", &Communicator::clock_offset_ns, py::call_guard<py::gil_scoped_release>())
#endif
      ;
}
