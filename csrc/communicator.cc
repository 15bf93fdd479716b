#include "communicator.h"

#include <cstdio>
#include <cstring>

#include "errors.h"

namespace rocenante {
namespace {

const char* dtype_name(DType d) {
  switch (d) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kInt32: return "int32";
  }
  return "?";
}
const char* op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
  }
  return "?";
}
std::string describe_call(size_t count, DType dtype, ReduceOp op) {
  return std::to_string(count) + " x " + dtype_name(dtype) + " (op " + op_name(op) + ")";
}

// What every rank must agree on before any line moves; sent in front of the transport's handle.
struct Config {
  uint32_t magic;
  uint32_t world;
  uint64_t capacity_bytes;
  int32_t on_gpu;
  uint32_t zero;  // explicit padding, always 0, so that memcmp compares only bytes we set
};
constexpr uint32_t kConfigMagic = 0x524f4331;  // "ROC1": bump when the protocol changes
static_assert(sizeof(Config) == 24, "Config travels as raw bytes: no implicit padding");

Config config_of(int world, size_t capacity_bytes, int device) {
  return Config{kConfigMagic, uint32_t(world), capacity_bytes, device >= 0, 0};
}

}  // namespace

Communicator::Communicator(int rank, int world, int device, size_t capacity_bytes, double timeout_s)
    : rank_(rank), world_(world), device_(device), timeout_s_(timeout_s), layout_{capacity_bytes, world} {
  if (world < 1 || world > kMaxRanks)
    ROCENANTE_THROW(InvalidArgument, "world size " + std::to_string(world) + " is outside 1.." + std::to_string(kMaxRanks));
  if (rank < 0 || rank >= world)
    ROCENANTE_THROW(InvalidArgument, "rank " + std::to_string(rank) + " is outside 0.." + std::to_string(world - 1));
  if (capacity_bytes == 0 || capacity_bytes % kCapacityGranule != 0 || capacity_bytes > kMaxCapacityBytes)
    ROCENANTE_THROW(InvalidArgument, "capacity " + std::to_string(capacity_bytes) + " bytes must be a positive multiple of " +
                                         std::to_string(kCapacityGranule) + " up to " + std::to_string(kMaxCapacityBytes));
  if (!(timeout_s > 0)) ROCENANTE_THROW(InvalidArgument, "timeout must be positive, got " + std::to_string(timeout_s));
  if (device_ < 0) {
    transport_ = make_shm_transport(rank, layout_);
  } else {
    kernel_ = make_oneshot_kernel(device_);
    transport_ = make_cuda_ipc_transport(rank, device_, layout_);
  }
}

Communicator::~Communicator() { close(); }

std::string Communicator::local_handle() const {
  if (closed()) ROCENANTE_THROW(Closed, "communicator is closed");
  const Config c = config_of(world_, layout_.capacity_bytes, device_);
  return std::string(reinterpret_cast<const char*>(&c), sizeof(c)) + transport_->local_handle();
}

void Communicator::connect(const std::vector<std::string>& handles) {
  if (closed()) ROCENANTE_THROW(Closed, "communicator is closed");
  if (int(handles.size()) != world_)
    ROCENANTE_THROW(InvalidArgument, "expected " + std::to_string(world_) + " handles, got " + std::to_string(handles.size()));
  const Config mine = config_of(world_, layout_.capacity_bytes, device_);
  std::vector<std::string> transport_handles(world_);
  for (int p = 0; p < world_; ++p) {
    Config theirs{};
    if (handles[p].size() < sizeof(Config)) ROCENANTE_THROW(Error, "rank " + std::to_string(p) + " sent a truncated handle");
    std::memcpy(&theirs, handles[p].data(), sizeof(Config));
    if (std::memcmp(&theirs, &mine, sizeof(Config)) != 0) {
      ROCENANTE_THROW(Error, "rank " + std::to_string(p) + " is configured differently: world " + std::to_string(theirs.world) +
                                 ", capacity " + std::to_string(theirs.capacity_bytes) + " bytes, " +
                                 (theirs.on_gpu ? "GPU" : "CPU") +
                                 (theirs.magic != kConfigMagic ? ", other rocenante version" : "") + "; this rank: world " +
                                 std::to_string(world_) + ", capacity " + std::to_string(layout_.capacity_bytes) +
                                 " bytes, " + (device_ >= 0 ? "GPU" : "CPU"));
    }
    transport_handles[p] = handles[p].substr(sizeof(Config));
  }
  transport_->connect(transport_handles);
}

void Communicator::all_connected() {
  if (closed()) ROCENANTE_THROW(Closed, "communicator is closed");
  transport_->all_connected();
}

void Communicator::validate(uintptr_t in, uintptr_t out, size_t count, DType dtype, ReduceOp op) const {
  if (uint32_t(dtype) >= kNumDTypes) ROCENANTE_THROW(InvalidArgument, "unsupported dtype code " + std::to_string(uint32_t(dtype)));
  if (uint32_t(op) >= kNumOps) ROCENANTE_THROW(InvalidArgument, "unsupported op code " + std::to_string(uint32_t(op)));
  if (dtype == DType::kInt32 && op == ReduceOp::kAvg) ROCENANTE_THROW(InvalidArgument, "op avg is not defined for int32");
  if (count == 0) return;
  const size_t esize = dtype_size(dtype);
  if (in == 0 || out == 0) ROCENANTE_THROW(InvalidArgument, "null input or output pointer");
  if (in % esize != 0 || out % esize != 0)
    ROCENANTE_THROW(InvalidArgument, "input and output must be aligned to their element size");
  if (count > layout_.capacity_bytes / esize)
    ROCENANTE_THROW(InvalidArgument, describe_call(count, dtype, op) + " is " + std::to_string(count * esize) +
                                         " bytes, over this communicator's capacity of " +
                                         std::to_string(layout_.capacity_bytes) + " bytes");
  const size_t bytes = count * esize;
  if (in != out && in < out + bytes && out < in + bytes)
    ROCENANTE_THROW(InvalidArgument, "input and output overlap without being the same buffer");
}

void Communicator::all_reduce(uintptr_t in, uintptr_t out, size_t count, DType dtype, ReduceOp op, uintptr_t stream) {
  if (closed()) ROCENANTE_THROW(Closed, "communicator is closed");
  check();
  validate(in, out, count, dtype, op);
  if (count == 0) return;

  AllReduceArgs a{};
  a.in = reinterpret_cast<const void*>(in);
  a.out = reinterpret_cast<void*>(out);
  a.count = count;
  a.bytes = count * dtype_size(dtype);
  a.dtype = dtype;
  a.op = op;
  a.signature = call_signature(count, dtype, op);
  a.rank = rank_;
  a.world = world_;
  a.layout = layout_;
  a.local = transport_->local_region();
  for (int p = 0; p < world_; ++p) a.peer[p] = p == rank_ ? nullptr : transport_->peer_region(p);
  a.timeout_ns = uint64_t(timeout_s_ * 1e9);

  if (kernel_) {
    kernel_->launch(a, stream);
    return;
  }
  const uint64_t fault = host_allreduce(a, host_epoch_);
  if (fault != 0) fail(fault, describe_call(count, dtype, op));
  ++host_epoch_;
}

void Communicator::check() {
  if (closed() || !kernel_) return;
  if (const uint64_t fault = kernel_->fault(); fault != 0) fail(fault, "");
}

void Communicator::fail(uint64_t fault, const std::string& this_call) {
  faulted_ = true;
  const std::string who = "rank " + std::to_string(rank_) + ": ";
  if (fault_kind(fault) == Fault::kPeerTimeout) {
    char seconds[32];
    std::snprintf(seconds, sizeof(seconds), "%g", timeout_s_);
    std::string missing;
    for (int p = 0; p < world_; ++p)
      if (fault_detail(fault) & (1u << p)) missing += " " + std::to_string(p);
    ROCENANTE_THROW(PeerTimeout, who + "timed out after " + seconds + " s waiting for rank(s)" + missing +
                                     "; the communicator is closed");
  }
  const uint32_t sig = fault_value(fault);
  ROCENANTE_THROW(CallMismatch, who + "rank " + std::to_string(fault_detail(fault)) + " called all_reduce with " +
                                    describe_call(signature_count(sig), signature_dtype(sig), signature_op(sig)) +
                                    (this_call.empty() ? "" : ", this rank with " + this_call) +
                                    "; every rank must pass the same size, dtype and op. The communicator is closed");
}

void Communicator::close() {
  kernel_.reset();  // waits for our kernels before the regions they write go away
  transport_.reset();
  faulted_ = false;
}

}  // namespace rocenante
