"""Compiling a module that exists only on the meta device (too big for memory): the
files are written with shapes and no values, and its weights come from a checkpoint."""

from __future__ import annotations

import os
import warnings

import torch
from dist_utils import run_distributed

from nnscaler import ComputeConfig, load_merged_state_dicts, parallelize
from nnscaler.models.gpt import GPTConfig, GPTWithLoss, make_batch
from nnscaler.runtime.module import ParallelModuleError

CFG = GPTConfig(vocab_size=32, n_layer=2, n_head=2, d_model=16, seq_len=8)


def _meta_model() -> GPTWithLoss:
    with torch.device("meta"):
        return GPTWithLoss(CFG)


def _config() -> ComputeConfig:
    return ComputeConfig(plan_ngpus=2, runtime_ngpus=2, trace_strategy="meta")


def test_compile_on_meta_writes_the_files(tmp_path):
    parallelize(_meta_model(), {"batch": make_batch(CFG, 4)}, "tp", _config(),
                gen_savedir=str(tmp_path), load_module=False)
    found = {name for _, _, names in os.walk(tmp_path) for name in names}
    assert {"gencode0.py", "gencode1.py", "fullmodel.pt"} <= found


def _load(rank, world, outdir, init):
    batch = make_batch(CFG, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = parallelize(_meta_model(), {"batch": batch}, "tp", _config(), gen_savedir=outdir,
                         init_module_params=init)
    torch.manual_seed(0)
    real = GPTWithLoss(CFG)
    load_merged_state_dicts(pm, real.state_dict())
    torch.testing.assert_close(pm(batch), real(batch), rtol=1e-5, atol=1e-6)
    return True


def test_meta_module_runs_from_a_checkpoint(tmp_path):
    assert run_distributed(_load, 2, str(tmp_path), False) == [True, True]


def _load_initial(rank, world, outdir):
    try:
        parallelize(_meta_model(), {"batch": make_batch(CFG, 4)}, "tp", _config(),
                    gen_savedir=outdir)
    except ParallelModuleError as e:
        return str(e)
    return "no error"


def test_initial_values_of_a_meta_module_are_refused(tmp_path):
    messages = run_distributed(_load_initial, 2, str(tmp_path))
    assert all("meta device" in m and "init_params=False" in m for m in messages)


def test_meta_compile_needs_no_values(tmp_path):
    # the module's parameters never leave the meta device during the compile
    model = _meta_model()
    parallelize(model, {"batch": make_batch(CFG, 4)}, "dp",
                ComputeConfig(plan_ngpus=1, runtime_ngpus=2, trace_strategy="meta"),
                gen_savedir=str(tmp_path), load_module=False)
    assert all(p.is_meta for p in model.parameters())
