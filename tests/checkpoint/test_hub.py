"""Hub-format weights in and out of parallel modules (nnscaler.checkpoint.hub), on 2 gloo
processes: a tiny Llama saved by transformers itself is loaded into tp and pp (built and
traced on the meta device) with the HF model's logits; trained under tp, exported, read
back by ``from_pretrained``; its per-rank files resharded into pp and dp with ZeRO; and
every bad folder refused on every rank with the module unchanged."""

from __future__ import annotations

import os
import shutil
import warnings

import pytest
import torch
from dist_utils import run_distributed
from torch import nn

import nnscaler
from nnscaler import checkpoint as ck

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

LLAMA = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=64, max_position_embeddings=64,
             tie_word_embeddings=True)
TOL = dict(rtol=1e-5, atol=1e-6)


def llama_config(**changes) -> transformers.LlamaConfig:
    config = transformers.LlamaConfig(**{**LLAMA, **changes})
    config._attn_implementation = "sdpa"
    return config


class WithLoss(nn.Module):
    """``forward(batch) -> (loss, logits)`` (a pipeline's forward returns the loss first)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         labels=batch["input_ids"])
        return out.loss, out.logits


def make_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """Two sequences, the second left-padded by 3 (the mask is traced, not read)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :3] = 0
    return {"input_ids": torch.randint(0, LLAMA["vocab_size"], (2, 8), generator=g),
            "attention_mask": mask}


def hf_logits(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


def parallel(policy: str, gen: str, plan_ngpus: int = 2,
             use_zero: bool = False) -> nnscaler.ParallelModule:
    """The meta-built wrapper, parallelized: no weights anywhere until they are loaded."""
    with nnscaler.meta_parameters():
        model = WithLoss(transformers.LlamaForCausalLM(llama_config()))
    config = nnscaler.ComputeConfig(plan_ngpus=plan_ngpus, runtime_ngpus=2, use_zero=use_zero,
                                    trace_strategy="meta", use_end2end=True,
                                    pas_config={"pipeline_nmicros": 1})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return nnscaler.parallelize(model, {"batch": make_batch()}, policy, config,
                                    gen_savedir=gen, init_module_params=False,
                                    instance_name=f"{policy}{plan_ngpus}{'z' if use_zero else ''}")


def logits_of(pm: nnscaler.ParallelModule, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    out = pm.infer_step([batch])[0] if pm.pipeline is not None else pm(batch)
    return out[1].detach()


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> dict:
    """The HF model (random weights), saved whole and in several shards, and bad copies."""
    root = tmp_path_factory.mktemp("hub")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_config())
    model.save_pretrained(root / "single", safe_serialization=True)
    model.save_pretrained(root / "sharded", safe_serialization=True, max_shard_size="20KB")
    assert len(list((root / "sharded").glob("model-*.safetensors"))) > 2
    transformers.LlamaForCausalLM(llama_config(intermediate_size=48)).save_pretrained(
        root / "bad_shape", safe_serialization=True)
    shutil.copytree(root / "sharded", root / "missing_shard")
    (root / "missing_shard" / "model-00002-of-00006.safetensors").unlink()
    shutil.copytree(root / "single", root / "truncated")
    path = root / "truncated" / "model.safetensors"
    os.truncate(path, path.stat().st_size - 100)
    weights = safetensors_torch.load_file(root / "single" / "model.safetensors")
    for name, change in (("extra_name", {"model.extra.weight": torch.zeros(3)}),
                         ("missing_name", {"model.norm.weight": None})):
        os.makedirs(root / name)
        changed = {k: v for k, v in {**weights, **change}.items() if v is not None}
        safetensors_torch.save_file(changed, root / name / "model.safetensors",
                                    metadata={"format": "pt"})
    return {"root": str(root), "logits": hf_logits(model, make_batch()),
            "weight_bytes": sum(p.nbytes for p in model.parameters())}


# -- loading pretrained weights ------------------------------------------------------------
BAD = ("bad_shape", "missing_shard", "truncated", "extra_name", "missing_name")


def _load_and_refuse(rank, world, root, gen):
    out = {}
    for policy, folder in (("tp", "sharded"), ("pp", "single")):
        pm = parallel(policy, gen)
        nnscaler.load_pretrained(pm, os.path.join(root, folder))
        out[policy] = logits_of(pm, make_batch())
        out[f"{policy}_fullmodel_bytes"] = os.path.getsize(
            os.path.join(pm.generated_dir(), "fullmodel.pt"))
    before = {k: v.clone() for k, v in pm.state_dict().items() if isinstance(v, torch.Tensor)}
    for bad in BAD:
        try:
            nnscaler.load_pretrained(pm, os.path.join(root, bad))
            out[bad] = "no error"
        except nnscaler.CheckpointError as e:
            out[bad] = str(e)
    after = pm.state_dict()
    out["unchanged"] = all(torch.equal(v, after[k]) for k, v in before.items())
    return out


def test_load_pretrained_into_tp_and_pp_and_refuse_bad_folders(hub, tmp_path):
    results = run_distributed(_load_and_refuse, 2, hub["root"], str(tmp_path))
    for r in results:
        torch.testing.assert_close(r["tp"], hub["logits"], **TOL)
        torch.testing.assert_close(r["pp"], hub["logits"], **TOL)
        assert r["unchanged"]
        # fullmodel.pt holds shapes and the buffers, no weights
        assert r["tp_fullmodel_bytes"] < hub["weight_bytes"] / 4
        assert r["pp_fullmodel_bytes"] < hub["weight_bytes"] / 4
    for r in results:
        # every rank raises, naming the key, the file and the shapes
        message = r["bad_shape"]
        assert "shape (48, 32)" in message and "(64, 32)" in message, message
        assert "mlp" in message and "bad_shape" in message and "model.safetensors" in message
        message = r["missing_shard"]
        assert "model-00002-of-00006.safetensors" in message and "missing" in message, message
        message = r["truncated"]
        assert "truncated" in message and "model.safetensors" in message, message
        assert "bytes" in message
        message = r["extra_name"]
        assert "'model.extra.weight'" in message and "(3,)" in message, message
        assert "matches no parameter" in message
        message = r["missing_name"]
        assert "model.model.norm.weight" in message and "not in the weights" in message, message


# -- training, exporting, resharding ---------------------------------------------------------
def _train_and_export(rank, world, root, gen, out):
    pm = parallel("tp", gen)
    nnscaler.load_pretrained(pm, os.path.join(root, "single"))
    optimizer = nnscaler.build_optimizer(pm, torch.optim.Adam, lr=1e-2)
    for step in range(3):
        pm.train_step([make_batch(step + 1)])
        optimizer.step()
    ck.save(pm.state_dict(), os.path.join(out, f"tp{rank}.pt"))
    nnscaler.save_pretrained(pm, os.path.join(out, "export"), llama_config(),
                             max_shard_size="30KB")
    return logits_of(pm, make_batch())


def _reshard(rank, world, out, gen):
    files = [os.path.join(out, f"tp{r}.pt") for r in range(world)]
    got = {}
    for policy, plan_ngpus, zero in (("pp", 2, False), ("dp", 1, True)):
        pm = parallel(policy, gen, plan_ngpus, zero)
        nnscaler.load_resharded(pm, files)
        got[policy] = logits_of(pm, make_batch())
    nnscaler.save_pretrained(pm, os.path.join(out, "export_zero"), llama_config())
    return got


def _tensors(folder: str) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            out.update(safetensors_torch.load_file(os.path.join(folder, f)))
    return out


def test_train_export_reshard_round_trip(hub, tmp_path):
    out, gen = tmp_path / "out", tmp_path / "gen"
    out.mkdir()
    trained = run_distributed(_train_and_export, 2, hub["root"], str(gen), str(out))
    torch.testing.assert_close(trained[0], trained[1])
    assert not torch.allclose(trained[0], hub["logits"])  # training moved the weights
    export = out / "export"
    assert (export / "model.safetensors.index.json").is_file()
    assert len(list(export.glob("model-*.safetensors"))) > 1
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary left
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(export)
    assert next(reloaded.parameters()).dtype == torch.float32
    torch.testing.assert_close(hf_logits(reloaded, make_batch()), trained[0], **TOL)
    # the per-rank files give the same folder, in one process
    files = [str(out / f"tp{r}.pt") for r in range(2)]
    ck.save_pretrained(files, out / "export_files", llama_config())
    exported = _tensors(str(export))
    assert "lm_head.weight" not in exported  # tied: written once, as HF writes it
    from_files = _tensors(str(out / "export_files"))
    assert set(from_files) == set(exported)
    for k, v in exported.items():
        assert torch.equal(from_files[k], v), k
    # a rank's file left out, or missing: refused, nothing written
    with pytest.raises(nnscaler.CheckpointError, match=r"hold \d+ of the \d+ elements of"):
        ck.save_pretrained(files[:1], out / "partial", llama_config())
    with pytest.raises(nnscaler.CheckpointError, match="nope.pt' does not exist"):
        ck.save_pretrained([files[0], str(out / "nope.pt")], out / "partial", llama_config())
    assert not (out / "partial").exists()
    # the tp files into pp and into dp with ZeRO, and ZeRO's module exported again
    resharded = run_distributed(_reshard, 2, str(out), str(gen))
    for r in resharded:
        torch.testing.assert_close(r["pp"], trained[0], **TOL)
        torch.testing.assert_close(r["dp"], trained[0], **TOL)
    for k, v in _tensors(str(out / "export_zero")).items():
        assert torch.equal(exported[k], v), k


def test_export_refuses_a_config_of_another_model(tmp_path):
    model = WithLoss(transformers.LlamaForCausalLM(llama_config()))
    with pytest.raises(nnscaler.CheckpointError) as info:
        ck.save_pretrained([model.state_dict()], tmp_path / "out",
                           llama_config(intermediate_size=48))
    message = str(info.value)
    assert "'model.model.layers.0.mlp.gate_proj.weight'" in message, message
    assert "(64, 32)" in message and "(48, 32)" in message, message
    assert not any(tmp_path.iterdir())  # nothing written


def test_export_of_a_plain_state_dict_strips_the_wrapper(tmp_path):
    torch.manual_seed(1)
    model = WithLoss(transformers.LlamaForCausalLM(llama_config()))
    ck.save_pretrained([model.state_dict()], tmp_path / "out", llama_config())
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    torch.testing.assert_close(hf_logits(reloaded, make_batch()),
                               hf_logits(model.model, make_batch()))


# -- names: the prefix found either way, or given ------------------------------------------
class Hidden(nn.Module):
    """The base model alone: its names lack the folder's ``model.`` (the prefix is added)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.layers_owner = model

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.layers_owner(input_ids=batch["input_ids"],
                                 attention_mask=batch["attention_mask"]).last_hidden_state


def _one_process(module: nn.Module, gen, name: str) -> nnscaler.ParallelModule:
    config = nnscaler.ComputeConfig(plan_ngpus=1, runtime_ngpus=1, trace_strategy="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return nnscaler.parallelize(module, {"batch": make_batch()}, "dp", config,
                                    gen_savedir=str(gen), init_module_params=False,
                                    instance_name=name)


def test_names_under_another_prefix_or_a_given_one(hub, tmp_path):
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(llama_config())  # the folder's weights
    # the folder says model.layers.0...; this module says layers_owner.layers.0...
    with nnscaler.meta_parameters():
        bare = Hidden(transformers.LlamaModel(llama_config()))
    pm = _one_process(bare, tmp_path, "bare")
    nnscaler.load_pretrained(pm, os.path.join(hub["root"], "single"))  # layers_owner. -> model.
    with torch.no_grad():
        want = reference.model(input_ids=make_batch()["input_ids"],
                               attention_mask=make_batch()["attention_mask"]).last_hidden_state
    torch.testing.assert_close(pm(make_batch()), want, **TOL)
    # the wrapper's prefix given instead of found
    with nnscaler.meta_parameters():
        wrapped = WithLoss(transformers.LlamaForCausalLM(llama_config()))
    pm = _one_process(wrapped, tmp_path, "wrapped")
    nnscaler.load_pretrained(pm, os.path.join(hub["root"], "single"), prefix="model.")
    torch.testing.assert_close(pm(make_batch())[1], hub["logits"], **TOL)
    with pytest.raises(nnscaler.CheckpointError, match="not in the weights"):
        nnscaler.load_pretrained(pm, os.path.join(hub["root"], "single"), prefix="other.")
