"""FlashInfer's unified all-reduce fusion pair, create_allreduce_fusion_workspace and allreduce_fusion, with its
names, keywords and defaults (flashinfer-python 0.7.4, flashinfer/comm/allreduce.py), serving
backend="rocenante". Patterns kAllReduce and kARResidualRMSNorm run on rocenante: the all-reduce, then the
residual add and RMSNorm fused into rocenante's kernel where it serves the shape (else the all-reduce followed
by torch ops), with the semantics of FlashInfer's TRT-LLM kernel. Every other backend
goes to FlashInfer when it is installed (logged once); without it, asking for one raises an error naming it.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Union

import torch

from rocenante import startup
from rocenante.flashinfer.bootstrap import rank_mismatch, rendezvous_on_comm_backend
from rocenante.flashinfer.workspace import RocenanteAllReduceWorkspace

logger = logging.getLogger("rocenante")

BACKEND = "rocenante"


class AllReduceFusionPattern:
    """The patterns rocenante runs, with FlashInfer's values (flashinfer.comm.AllReduceFusionPattern)."""

    kAllReduce = 0
    kARResidualRMSNorm = 1


class RocenanteFusionWorkspace:
    """What create_allreduce_fusion_workspace(backend="rocenante") returns: the face of FlashInfer's
    AllReduceFusionWorkspace (world_size, rank, backend, is_buffer_size_sufficient, destroy) over a
    RocenanteAllReduceWorkspace (``.allreduce``), sized for max_token_num x hidden_dim elements of dtype."""

    def __init__(self, allreduce: RocenanteAllReduceWorkspace):
        self.allreduce = allreduce
        self.world_size, self.rank = allreduce.world_size, allreduce.rank

    @property
    def backend(self) -> str:
        return BACKEND

    def is_buffer_size_sufficient(self, tp_size: int, num_tokens: int, hidden_dim: int, dtype: torch.dtype,
                                  use_oneshot: Optional[Any] = None) -> bool:
        esize = torch.empty((), dtype=dtype).element_size()
        return tp_size == self.world_size and num_tokens * hidden_dim * esize <= self.allreduce.max_bytes

    def destroy(self) -> None:
        """Collective: every rank calls it (see RocenanteAllReduceWorkspace.destroy). Idempotent."""
        self.allreduce.destroy()


def _flashinfer_defining_module():
    """FlashInfer's own unified pair, as FlashInfer defines them (never the patched names), or None."""
    try:
        from flashinfer.comm import allreduce as defining
    except ImportError:
        return None
    return defining


_passed_on: set = set()


def _pass_on(what: str):
    """FlashInfer's own function `what`, logged once per function; an error naming it without FlashInfer."""
    from rocenante.flashinfer import patch  # patch.py imports this module

    defining = _flashinfer_defining_module()
    if defining is None:
        raise ValueError(f"{what}: this is not a rocenante backend or workspace, and FlashInfer is not installed "
                         "to serve it (pip install flashinfer-python)")
    if what not in _passed_on:
        _passed_on.add(what)
        logger.info("rocenante.flashinfer: %s for another backend goes to FlashInfer", what)
    return patch.original(defining, what)


def create_allreduce_fusion_workspace(
    backend: str = "auto",
    world_size: int = None,
    rank: int = None,
    max_token_num: int = None,
    hidden_dim: int = None,
    dtype: torch.dtype = None,
    gpus_per_node: int = None,
    comm_backend=None,
    force_oneshot_support: bool = False,
    group=None,
    *,
    top_k: Optional[int] = None,
    rms_eps: Optional[float] = None,
    weight_bias: Optional[float] = None,
    routed_scaling_factor: Optional[float] = None,
    include_shared_expert: Optional[bool] = None,
    add_residual: Optional[bool] = None,
    write_residual_output: Optional[bool] = None,
    apply_rms_norm: Optional[bool] = None,
    output_dtype: Optional[torch.dtype] = None,
    dynamic_fp8: Optional[bool] = None,
    write_norm_output: Optional[bool] = None,
    config=None,
):
    """backend="rocenante": a RocenanteFusionWorkspace for every rank of ``comm_backend`` (a FlashInfer
    CommBackend: rank 0 opens a TCPStore and broadcasts its address through it) or else of ``group`` (default:
    the world group). Collective; it is built on every rank or raises the same error on every rank.
    ``gpus_per_node`` and ``force_oneshot_support`` are accepted (rocenante is one-shot, on one host); the
    keyword-only options are the MNNVL CuTe DSL backend's and are refused, as FlashInfer refuses them for its
    other backends. Any other backend: FlashInfer's own function."""
    if backend != BACKEND:
        return _pass_on("create_allreduce_fusion_workspace")(
            backend, world_size, rank, max_token_num, hidden_dim, dtype, gpus_per_node, comm_backend,
            force_oneshot_support, group, top_k=top_k, rms_eps=rms_eps, weight_bias=weight_bias,
            routed_scaling_factor=routed_scaling_factor, include_shared_expert=include_shared_expert,
            add_residual=add_residual, write_residual_output=write_residual_output, apply_rms_norm=apply_rms_norm,
            output_dtype=output_dtype, dynamic_fp8=dynamic_fp8, write_norm_output=write_norm_output, config=config)
    refused = [name for name, value in (
        ("top_k", top_k), ("rms_eps", rms_eps), ("weight_bias", weight_bias),
        ("routed_scaling_factor", routed_scaling_factor), ("include_shared_expert", include_shared_expert),
        ("add_residual", add_residual), ("write_residual_output", write_residual_output),
        ("apply_rms_norm", apply_rms_norm), ("output_dtype", output_dtype), ("dynamic_fp8", dynamic_fp8),
        ("write_norm_output", write_norm_output), ("config", config)) if value is not None]
    if refused:  # the same on every rank: raised before any collective
        raise ValueError("backend='rocenante' does not take " + ", ".join(refused) +
                         " (FlashInfer's MNNVL CuTe DSL options; rms_eps and weight_bias go to allreduce_fusion)")
    if max_token_num is None or hidden_dim is None or dtype is None:
        raise ValueError("backend='rocenante' needs max_token_num, hidden_dim and dtype")
    if comm_backend is not None:
        rendezvous = rendezvous_on_comm_backend(comm_backend)
    else:
        import torch.distributed as dist

        if group is None and not dist.is_initialized():
            raise ValueError("backend='rocenante' needs comm_backend=, group= or an initialized torch.distributed")
        rendezvous = startup.rendezvous_on_group(group if group is not None else dist.group.WORLD, "flashinfer")
    workspace = RocenanteAllReduceWorkspace._on(rendezvous, int(max_token_num) * int(hidden_dim), dtype,
                                                rank_mismatch(rendezvous, world_size, rank))
    return RocenanteFusionWorkspace(workspace)


# allreduce_fusion's arguments that belong to patterns rocenante does not run: each must be left at its default.
_OTHER_PATTERNS_DEFAULTS = {
    "quant_out": None, "scale_out": None, "scale_factor": None, "moe_reduction_device_num_experts": None,
    "moe_reduction_scale_input": None, "moe_reduction_active_experts_token_input": None,
    "moe_reduction_token_input": None, "expanded_idx_to_permuted_idx": None, "expert_scale_factor": None,
    "shared_expert_output": None, "block_quant_group_size": None, "moe_finalize_backend": "trtllm",
}


def allreduce_fusion(
    input: torch.Tensor,
    workspace,
    pattern: int,
    launch_with_pdl: bool = False,
    trigger_completion_at_end: bool = True,
    output: Optional[torch.Tensor] = None,
    residual_out: Optional[torch.Tensor] = None,
    norm_out: Optional[torch.Tensor] = None,
    quant_out: Optional[torch.Tensor] = None,
    scale_out: Optional[torch.Tensor] = None,
    residual_in: Optional[torch.Tensor] = None,
    rms_gamma: Optional[torch.Tensor] = None,
    rms_eps: float = 1e-6,
    scale_factor: Optional[Union[torch.Tensor, float]] = None,
    layout_code: Optional[int] = None,
    use_oneshot: Optional[bool] = None,
    fp32_acc: bool = False,
    moe_reduction_device_num_experts: Optional[int] = None,
    moe_reduction_scale_input: Optional[torch.Tensor] = None,
    moe_reduction_active_experts_token_input: Optional[torch.Tensor] = None,
    moe_reduction_token_input: Optional[torch.Tensor] = None,
    expanded_idx_to_permuted_idx: Optional[torch.Tensor] = None,
    expert_scale_factor: Optional[torch.Tensor] = None,
    shared_expert_output: Optional[torch.Tensor] = None,
    block_quant_group_size: Optional[int] = None,
    weight_bias: float = 0.0,
    *,
    moe_finalize_backend: str = "trtllm",
) -> torch.Tensor:
    """On a RocenanteFusionWorkspace:

    - ``kAllReduce``: ``output`` (allocated if None) = sum over ranks of ``input``; returns ``output``.
    - ``kARResidualRMSNorm``: ``residual_out = allreduce(input) + residual_in`` and ``norm_out =
      rmsnorm(residual_out) * (rms_gamma + weight_bias)`` (both allocated if None; ``output`` is not written,
      as in FlashInfer); returns ``norm_out``. As FlashInfer's TRT-LLM kernel computes it: the all-reduce is
      rounded to the input's dtype, the residual added in fp32 and rounded, and the norm computed in fp32 from
      the rounded ``residual_out``: ``r * rsqrt(mean(r^2) + rms_eps) * (weight_bias + gamma)``, rounded once.
      On a GPU, when ``Communicator.fuses_add_rmsnorm`` accepts the shape (float dtypes, rows of a multiple of
      16 bytes up to 32 KiB, ``rms_gamma`` of the input's dtype: decided by shapes and dtypes, so alike on every
      rank), all of it runs in rocenante's one kernel; otherwise as the all-reduce followed by torch ops. Both
      give the same ``residual_out`` bits; ``norm_out`` may differ by one unit in the last place in bf16/fp16,
      by less than 2^-16 relative in fp32 (the row's squares are added in another order).

    Arguments that choose what runs (the pattern, another pattern's arguments, a missing ``residual_in`` or
    ``rms_gamma``) raise ValueError and leave the workspace usable: SPMD code passes them alike on every rank.
    A tensor that does not fit (device, contiguity, shape, dtype) is something only this rank can see, while its
    peers may be in the call already: the call is refused on every rank at once (ValueError here, the peers
    raise an error naming this rank), and the workspace is faulted.

    Accepted and without effect here: ``launch_with_pdl`` and ``trigger_completion_at_end`` (rocenante's
    kernel always waits for its predecessor's writes and completes at its end), ``use_oneshot`` (always
    one-shot), ``fp32_acc`` (rocenante always accumulates in fp32, in rank order), ``layout_code`` (FlashInfer
    ignores it too for these patterns). Any other pattern, or an argument of another pattern, raises
    ValueError naming it. Any other workspace: FlashInfer's own function.
    """
    if not isinstance(workspace, RocenanteFusionWorkspace):
        return _pass_on("allreduce_fusion")(
            input, workspace, pattern, launch_with_pdl, trigger_completion_at_end, output, residual_out, norm_out,
            quant_out, scale_out, residual_in, rms_gamma, rms_eps, scale_factor, layout_code, use_oneshot, fp32_acc,
            moe_reduction_device_num_experts, moe_reduction_scale_input, moe_reduction_active_experts_token_input,
            moe_reduction_token_input, expanded_idx_to_permuted_idx, expert_scale_factor, shared_expert_output,
            block_quant_group_size, weight_bias, moe_finalize_backend=moe_finalize_backend)
    given = dict(quant_out=quant_out, scale_out=scale_out, scale_factor=scale_factor,
                 moe_reduction_device_num_experts=moe_reduction_device_num_experts,
                 moe_reduction_scale_input=moe_reduction_scale_input,
                 moe_reduction_active_experts_token_input=moe_reduction_active_experts_token_input,
                 moe_reduction_token_input=moe_reduction_token_input,
                 expanded_idx_to_permuted_idx=expanded_idx_to_permuted_idx, expert_scale_factor=expert_scale_factor,
                 shared_expert_output=shared_expert_output, block_quant_group_size=block_quant_group_size,
                 moe_finalize_backend=moe_finalize_backend)
    stray = [name for name, default in _OTHER_PATTERNS_DEFAULTS.items() if given[name] != default]
    if stray:
        raise ValueError(f"a rocenante workspace runs kAllReduce and kARResidualRMSNorm; {', '.join(stray)} "
                         "belong to other patterns (use a FlashInfer workspace for those)")
    comm = workspace.allreduce
    if pattern not in (AllReduceFusionPattern.kAllReduce, AllReduceFusionPattern.kARResidualRMSNorm):
        raise ValueError(f"pattern {pattern}: a rocenante workspace runs kAllReduce (0) and kARResidualRMSNorm "
                         "(1); use a FlashInfer workspace for the others")
    if pattern == AllReduceFusionPattern.kARResidualRMSNorm and (residual_in is None or rms_gamma is None):
        raise ValueError("kARResidualRMSNorm needs residual_in and rms_gamma")
    # What the tensors are only this rank can see, and its peers may be in the call already: a check that fails
    # refuses the call, which tells them at once (the workspace is faulted on every rank).
    refuse = comm._alive().refuse
    if input.device != comm.device:
        refuse(f"input is on {input.device} but the workspace was built on {comm.device}")
    if not input.is_contiguous():
        refuse("input must be contiguous")
    if pattern == AllReduceFusionPattern.kAllReduce:
        return comm.all_reduce(input, out=output)
    for name, t in (("residual_in", residual_in), ("residual_out", residual_out), ("norm_out", norm_out)):
        if t is not None and (t.shape != input.shape or t.dtype != input.dtype or t.device != input.device
                              or not t.is_contiguous()):
            refuse(f"{name} must be contiguous, of the input's shape {tuple(input.shape)}, dtype {input.dtype} and "
                   f"device {input.device}; got {tuple(t.shape)} {t.dtype} on {t.device}")
    if rms_gamma.shape != input.shape[-1:] or rms_gamma.device != input.device:
        refuse(f"rms_gamma must have shape {tuple(input.shape[-1:])} on {input.device}, got "
               f"{tuple(rms_gamma.shape)} on {rms_gamma.device}")
    if residual_out is None:
        residual_out = torch.empty_like(input)
    if norm_out is None:
        norm_out = torch.empty_like(input)
    # One kernel where the communicator fuses the shape (the same answer on every rank).
    gamma = rms_gamma.contiguous()
    if comm.supports(input) and comm._alive().fuses_add_rmsnorm(input, gamma):
        comm._alive().all_reduce_add_rmsnorm(input, residual_in, gamma, rms_eps, weight_bias, residual_out, norm_out)
        return norm_out
    # The all-reduce lands in residual_out, unless that would overwrite residual_in before it is read.
    summed = residual_out if not _overlaps(residual_out, residual_in) else torch.empty_like(input)
    comm.all_reduce(input, out=summed)
    add_rmsnorm(summed, residual_in, rms_gamma, rms_eps, weight_bias, residual_out, norm_out)
    return norm_out


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def add_rmsnorm(summed: torch.Tensor, residual_in: torch.Tensor, gamma: torch.Tensor, eps: float,
                weight_bias: float, residual_out: torch.Tensor, norm_out: torch.Tensor) -> None:
    """residual_out = summed + residual_in (fp32 add, one rounding); norm_out = RMSNorm of the rounded
    residual_out over the last dimension, in fp32, times (weight_bias + gamma), rounded once. `summed` may be
    residual_out itself."""
    torch.add(summed, residual_in, out=residual_out)  # torch adds bf16/fp16 in fp32 and rounds once
    r = residual_out.float()  # residual_out itself when it is fp32: read only
    normed = r * torch.rsqrt(r.square().mean(-1, keepdim=True) + eps)
    normed.mul_(gamma.float() + weight_bias)
    norm_out.copy_(normed)
