"""Published figures the model is checked against: the one place they live (tests pin them)."""

KIB = 1024

# NVIDIA's DGX Spark cluster benchmark: dense Qwen3.8-27B, NVFP4, no speculative decoding/MTP, tensor parallel
# across nodes, one GB10 per node, ConnectX-7 RoCE. (nodes, topology, all-reduce) -> (decode, prefill) tokens/s.
DECODE_ROWS = [
    # nodes, topology, all-reduce, decode tok/s, prefill tok/s
    (2, "direct cable", "nccl", 11.86, 2635),
    (4, "physical ring", "nccl", 32.82, 4446),
    (4, "switch", "one-shot", 36.34, 4556),
    (8, "physical ring", "nccl", 40.11, 4962),
    (8, "switch", "one-shot", 52.58, 5105),
]
# Same article: decode scaling at 8 nodes, one-shot 4.43x against 3.05x for NCCL on the switch (no table row).
# 52.58 / 11.86 = 4.433: the baseline of these ratios is the 2-node row, so that is the baseline used here.
SCALING_8 = {"one-shot": 4.43, "nccl switch": 3.05}

# bf16 all-reduce in CUDA graphs on 4 Sparks, microseconds: bytes -> (one-shot, NCCL).
# "1.5 MB" is read as 1.5 MiB (the benchmark's power-of-two size grid).
ALLREDUCE_4 = {8 * KIB: (15.5, 51.3), 48 * KIB: (23.0, 59.0), 1536 * KIB: (277.0, 877.0)}
# NCCL on 2 Sparks, microseconds.
NCCL_2 = {8 * KIB: 35.2, 16 * KIB: 31.7, 32 * KIB: 39.6, 64 * KIB: 67.9}
# ib_write_lat, 48 KiB, microseconds.
IB_WRITE_LAT_48K_US = 8.8
# Each Spark port: two PCIe Gen5 x4 functions of ~93-97 Gb/s; one function's midpoint, bytes/s.
FUNCTION_BPS = 95e9 / 8
