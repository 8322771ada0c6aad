"""``NnScalerStrategy`` inside ``lightning.Trainer`` on 2 gloo processes: 20 steps with
the losses of the same run under Lightning's ``ddp`` strategy (rtol 1e-5); the
checkpoint folder merges into the plain model, equal to the ddp model's weights; a
run resumed from the checkpoint ModelCheckpoint wrote at step 10 continues exactly as
the ddp run resumed from its own."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from dist_utils import run_distributed

pytest.importorskip("lightning")

STEPS = 20


def _module_and_data():
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, Dataset

    from nnscaler.models.gpt import GPTConfig, GPTWithLoss, make_batch

    config = GPTConfig(vocab_size=32, n_layer=2, n_head=2, d_model=16, seq_len=8)

    class Tokens(Dataset):
        def __init__(self) -> None:
            batch = make_batch(config, 2 * STEPS, seed=1)  # 10 steps an epoch per rank
            self.ids, self.labels = batch["input_ids"], batch["labels"]

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.labels[i]}

    class LitGPT(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = GPTWithLoss(config)
            self.example_input_array = {"batch": make_batch(config, 2)}
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            loss = self.model(batch)
            self.log("train_loss", loss, prog_bar=True, sync_dist=True)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def loader():
        # the same fixed shard per rank for ddp and for the strategy's 2 scale units (1
        # device each); Lightning's own sampler is off: on a resumed run it does not
        # replay the order of the interrupted epoch
        import torch.distributed as dist
        from torch.utils.data import DistributedSampler

        data = Tokens()
        sampler = DistributedSampler(data, num_replicas=2, rank=dist.get_rank(), shuffle=False)
        return DataLoader(data, batch_size=2, sampler=sampler)

    return LitGPT, loader, config


def _trainer(strategy, steps, tmp, **kw):
    import lightning.pytorch as pl

    return pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, precision="32-true",
                      max_steps=steps, logger=False, use_distributed_sampler=False,
                      enable_checkpointing="callbacks" in kw, enable_model_summary=False,
                      default_root_dir=tmp, **kw)


def _worker(rank, world, tmp):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from nnscaler import ComputeConfig
    from nnscaler.integration.lightning import (
        NnScalerStrategy,
        merge_checkpoint,
        rank_checkpoint_path,
    )
    from nnscaler.models.gpt import GPTWithLoss

    warnings.simplefilter("ignore")
    LitGPT, loader, config = _module_and_data()

    def strategy():
        return NnScalerStrategy(compute_config=ComputeConfig(plan_ngpus=1, runtime_ngpus=2),
                                pas_policy="dp", gen_savedir=os.path.join(tmp, "gen"))

    ddp = LitGPT()
    ddp_ckpts = ModelCheckpoint(dirpath=os.path.join(tmp, "ddp"), save_top_k=-1,
                                every_n_epochs=1, save_on_train_epoch_end=True)
    _trainer("ddp", STEPS, tmp, enable_progress_bar=False, callbacks=[ddp_ckpts]).fit(
        ddp, loader())
    ddp_params = {n: p.detach().clone() for n, p in ddp.model.named_parameters()}

    ours = LitGPT()
    ckpt_dir = os.path.join(tmp, "ckpts")
    every_epoch = ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, every_n_epochs=1,
                                  save_on_train_epoch_end=True)
    trainer = _trainer(strategy(), STEPS, tmp, callbacks=[every_epoch])  # progress bar on
    trainer.fit(ours, loader())
    torch.testing.assert_close(torch.tensor(ours.losses), torch.tensor(ddp.losses),
                               rtol=1e-5, atol=1e-6)
    assert trainer.callback_metrics["train_loss"].numel() == 1    # logging works
    full = os.path.join(tmp, "full.ckpt")
    trainer.save_checkpoint(full)
    merged, opt_state = merge_checkpoint(full)
    plain = GPTWithLoss(config)
    plain.load_state_dict(merged)
    for name, p in plain.named_parameters():
        torch.testing.assert_close(p.detach(), ddp_params[name], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=name: f"merged {n}: {m}")
    assert opt_state is not None and opt_state["state"]

    # the checkpoint ModelCheckpoint wrote at the end of the first epoch (step 10)
    mid = os.path.join(ckpt_dir, f"epoch=0-step={STEPS // 2}.ckpt")
    assert os.path.isfile(rank_checkpoint_path(mid, rank))
    resumed = LitGPT()
    _trainer(strategy(), STEPS, tmp, enable_progress_bar=False).fit(resumed, loader(),
                                                                    ckpt_path=mid)
    # Lightning (2.6) replays the first batch of the epoch after resuming from an
    # end-of-epoch checkpoint with a plain DataLoader, under ddp too: the resumed run
    # must be the ddp run resumed from its own checkpoint, and its first step the
    # uninterrupted run's
    ddp_resumed = LitGPT()
    _trainer("ddp", STEPS, tmp, enable_progress_bar=False).fit(
        ddp_resumed, loader(), ckpt_path=os.path.join(tmp, "ddp", f"epoch=0-step={STEPS // 2}.ckpt"))
    torch.testing.assert_close(torch.tensor(resumed.losses), torch.tensor(ddp_resumed.losses),
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(resumed.losses[0], ours.losses[STEPS // 2], rtol=1e-5,
                               atol=1e-6)
    return len(ours.losses)


@pytest.mark.slow
def test_lightning_strategy_matches_ddp_merges_and_resumes(tmp_path):
    assert run_distributed(_worker, 2, str(tmp_path), timeout=600) == [STEPS, STEPS]


def test_end2end_config_is_refused():
    from nnscaler import ComputeConfig
    from nnscaler.integration.lightning import LightningIntegrationError, NnScalerStrategy

    with pytest.raises(LightningIntegrationError, match="use_end2end=False"):
        NnScalerStrategy(ComputeConfig(plan_ngpus=1, runtime_ngpus=1, use_end2end=True))


ZERO_STEPS = 6


def _zero_worker(rank, world, tmp):
    """ddp, then the strategy with ZeRO stages 2, 3 and 'auto' (under autodist, which
    chooses the stage), each ``ZERO_STEPS`` steps of Adam
    from the same weights on the same shards: the losses agree, and the checkpoint folder
    of each stage merges into the ddp model's weights."""
    from nnscaler import ComputeConfig
    from nnscaler.integration.lightning import NnScalerStrategy, merge_checkpoint
    from nnscaler.models.gpt import GPTWithLoss

    warnings.simplefilter("ignore")
    LitGPT, loader, config = _module_and_data()

    class LitAdam(LitGPT):
        def configure_optimizers(self):  # Adam's eps: see tests/parity_utils.py
            return torch.optim.Adam(self.parameters(), lr=1e-3, eps=1e-4)

    ddp = LitAdam()
    _trainer("ddp", ZERO_STEPS, tmp, enable_progress_bar=False).fit(ddp, loader())
    out = {}
    for stage in (2, 3, "auto"):  # 'auto': autodist chooses the stage
        ours = LitAdam()
        strategy = NnScalerStrategy(
            compute_config=ComputeConfig(plan_ngpus=1, runtime_ngpus=2, zero_stage=stage),
            pas_policy="autodist" if stage == "auto" else "dp",
            gen_savedir=os.path.join(tmp, f"gen{stage}"))
        trainer = _trainer(strategy, ZERO_STEPS, tmp, enable_progress_bar=False)
        trainer.fit(ours, loader())
        torch.testing.assert_close(torch.tensor(ours.losses), torch.tensor(ddp.losses),
                                   rtol=1e-5, atol=1e-6)
        chosen = ours.model.reducers[0].stage
        assert chosen == stage or (stage == "auto" and chosen in (0, 1, 2, 3))
        path = os.path.join(tmp, f"zero{stage}.ckpt")
        trainer.save_checkpoint(path)
        if stage == 3:  # each rank's file holds its shards, not gathered parameters
            from nnscaler.integration.lightning import rank_checkpoint_path

            saved = torch.load(rank_checkpoint_path(path, rank), weights_only=False)
            assert [v["zero3"] for k, v in saved["state_dict"].items()
                    if k.endswith("_extra_state")][0]
        merged, _ = merge_checkpoint(path)
        plain = GPTWithLoss(config)
        plain.load_state_dict(merged)
        for (name, p), q in zip(plain.named_parameters(), ddp.model.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=name, s=stage: f"zero{s} merged {n}: {m}")
        out[stage] = len(ours.losses)
    return out


def test_lightning_strategy_with_zero_stages_2_3_and_auto(tmp_path):
    expected = {2: ZERO_STEPS, 3: ZERO_STEPS, "auto": ZERO_STEPS}
    assert run_distributed(_zero_worker, 2, str(tmp_path), timeout=600) == [expected] * 2
