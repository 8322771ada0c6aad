"""nnScaler's dummy inputs under Lightning: ``dummy_forward_args_fn`` on the
LightningModule (applied to the first training batch) and ``dummy_forward_args``; the
run equals Lightning's own single-device run."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from dist_utils import run_distributed

pytest.importorskip("lightning")


def _run(tmp, how):
    import lightning.pytorch as pl
    from cli.common import MLP, FixedDataset
    from torch.utils.data import DataLoader

    from nnscaler import ComputeConfig
    from nnscaler.integration.lightning import NnScalerStrategy

    warnings.simplefilter("ignore")

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = MLP()
            self.losses: list[float] = []
            if how == "fn":
                self.dummy_forward_args_fn = lambda batch: {"data": batch}
            elif how == "dict":
                self.dummy_forward_args = {"data": FixedDataset(size=4)[0:4]}

        def training_step(self, batch, batch_idx):
            loss = self.model(batch)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    strategy = "auto" if how == "plain" else NnScalerStrategy(
        compute_config=ComputeConfig(1, 1), pas_policy="dp",
        gen_savedir=os.path.join(tmp, f"gen-{how}"))
    lit = Lit()
    pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=4, logger=False,
               enable_checkpointing=False, enable_progress_bar=False,
               use_distributed_sampler=False,
               enable_model_summary=False, default_root_dir=tmp).fit(
        lit, DataLoader(FixedDataset(size=16), batch_size=4))
    return lit.losses


def _worker(rank, world, tmp):
    return {how: _run(tmp, how) for how in ("plain", "fn", "dict")}


def test_dummy_forward_args_fn_and_dict(tmp_path):
    (out,) = run_distributed(_worker, 1, str(tmp_path))
    assert len(out["plain"]) == 4
    torch.testing.assert_close(out["fn"], out["plain"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out["dict"], out["plain"], rtol=1e-5, atol=1e-6)
