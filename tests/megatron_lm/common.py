"""Shared helpers for the Megatron-LM integration tests."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Megatron-LM's defaults (core_v0.16.1 and core_v0.19.0 agree) for every argument the TSP hooks
# read; the CI tests run without a Megatron-LM checkout, so they build the namespace from these.
MEGATRON_DEFAULTS = dict(
    tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=1,
    hierarchical_context_parallel_sizes=None, hybrid_context_parallel=False,
    expert_model_parallel_size=1, sequence_parallel=False, tp_comm_overlap=False,
    num_experts=None, sft=False, dataloader_inter_document_masking=False,
    reset_attention_mask=False, reset_position_ids=False, multi_latent_attention=False,
    qk_layernorm=False, use_legacy_models=False, mtp_num_layers=None,
    experimental_attention_variant=None, heterogeneous_layers_config_path=None, yaml_cfg=None,
    fp8=None, fp4=None, transformer_impl="transformer_engine", spec=None,
    tensor_parallel_num_weight_shards=None, group_query_attention=False, num_query_groups=1,
    num_attention_heads=None, hidden_size=None, ffn_hidden_size=None, seq_length=None,
    padded_vocab_size=None, world_size=1, use_megatron_fsdp=False, use_torch_fsdp2=False,
    enable_cuda_graph=False, external_cuda_graph=False, cuda_graph_impl="none",
    num_layers_per_virtual_pipeline_stage=None, num_virtual_stages_per_pipeline_rank=None,
    pipeline_model_parallel_layout=None,
)


class _Backend:
    """Stands in for Megatron's ``AttnBackend`` enum members (only ``.name`` is read)."""

    def __init__(self, name):
        self.name = name


def megatron_parser() -> argparse.ArgumentParser:
    """A real argparse parser holding the TSP group and the Megatron flags the hooks read."""
    from megatron_tsp.megatron_lm.arguments import add_tsp_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    for dest, default in MEGATRON_DEFAULTS.items():
        flag = "--" + dest.replace("_", "-")
        if isinstance(default, bool):
            parser.add_argument(flag, action="store_true")
        elif dest == "spec":
            parser.add_argument(flag, nargs="*", default=None)
        elif dest in ("transformer_impl", "fp8", "fp4", "yaml_cfg", "cuda_graph_impl",
                      "pipeline_model_parallel_layout",
                      "heterogeneous_layers_config_path", "experimental_attention_variant"):
            parser.add_argument(flag, default=default)
        elif dest == "hierarchical_context_parallel_sizes":
            parser.add_argument(flag, nargs="+", type=int, default=None)
        else:
            parser.add_argument(flag, type=int, default=default)
    parser.add_argument("--attention-backend", type=_Backend, default=_Backend("auto"))
    parser.add_argument("--no-create-attention-mask-in-dataloader", action="store_false",
                        dest="create_attention_mask_in_dataloader")
    return add_tsp_arguments(parser)


def megatron_lm_path() -> Optional[str]:
    path = os.environ.get("MEGATRON_LM_PATH")
    return path if path and os.path.isfile(os.path.join(path, "pretrain_gpt.py")) else None


def run_launcher(args: List[str], timeout: float = 300, env_extra: Optional[dict] = None):
    """``python -m megatron_tsp.launch <args>`` in a subprocess (CPU, no CUDA)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "megatron_tsp.launch", *args], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=REPO)
