"""No pickle on resume for the strategies that load their own files (DeepSpeed ZeRO-2/3, FSDP2).

Real 2-process gloo jobs: a checkpoint planted with a ``__reduce__`` payload (it would write ``MARKER``)
is refused on every rank with ``UnsafeCheckpointError`` naming the file and the type, and nothing runs;
``weights_only=False`` loads it (the user said they trust it: the payload runs); ordinary checkpoints
resume exactly as before; a refused load leaves the strategy able to load an older checkpoint next.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch

from lplugins import _lightning
from lplugins.callbacks import UnsafeCheckpointError
from tests._dist import run_together

COMMON = r"""
import functools, glob, json, os, pickle, shutil, sys, time, warnings
import torch
import lightning.pytorch as pl
import lplugins
from lplugins import _lightning
from lplugins.callbacks import UnsafeCheckpointError
from tests.models import Regression, regression_loader

KIND = sys.argv[1]
ESCAPE = "with weights_only=False, as asked"


class Payload:
    def __reduce__(self):
        return (exec, ("open('MARKER', 'a').write('ran')",))


class Partial(Regression):
    # a Hydra-style hyper-parameter: functools.partial is not a weights-only type
    def __init__(self, make_optimizer=None):
        super().__init__(8, (16,), lr=1e-2)
        self.save_hyperparameters()


def strategy():
    if KIND.startswith("fsdp2"):
        from lplugins.strategies import FSDP2Strategy
        return FSDP2Strategy(save_distributed_checkpoint=KIND == "fsdp2_sharded")
    return KIND


def fit(max_steps, ckpt_path=None, model=None, wrap=None, **kw):
    pl.seed_everything(0, verbose=False)
    model = model or Regression(8, (16,), lr=1e-2)
    trainer = pl.Trainer(**lplugins.compose(
        strategy=strategy(), accelerator="cpu", devices=2, max_steps=max_steps, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False))
    if wrap is not None:
        wrap(trainer.strategy)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(model, regression_loader(64, features=8, batch_size=8), ckpt_path=ckpt_path, **kw)
            error = None
        except UnsafeCheckpointError as err:
            error = str(err)
    escapes = sum(ESCAPE in str(w.message) for w in caught)
    return trainer, model, error, escapes


def wait_for(path):
    deadline = time.monotonic() + 120
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"rank 0 did not write {path}"
        time.sleep(0.05)


def plant(src, dst, pattern, how="torch"):
    # rank 0 copies a good checkpoint and adds a payload to one of its files; the others wait for it
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        if os.path.isdir(src):
            shutil.copytree(src, dst)
        else:
            shutil.copy(src, dst)
        files = [dst] if os.path.isfile(dst) else sorted(glob.glob(os.path.join(dst, "**", pattern), recursive=True))
        target = files[-1]
        if how == "pickle":  # a plain pickle (torch.distributed.checkpoint's .metadata)
            with open(target, "rb") as f:
                obj = pickle.load(f)
            obj.planner_data["payload"] = Payload()
            with open(target, "wb") as f:
                pickle.dump(obj, f)
        else:
            obj = torch.load(target, weights_only=False)
            obj["payload"] = Payload()
            torch.save(obj, target)
        with open(dst + ".ready", "w") as f:
            f.write(os.path.relpath(target, dst) if os.path.isdir(dst) else os.path.basename(target))
    wait_for(dst + ".ready")
    with open(dst + ".ready") as f:
        return f.read()


def fallback(strategy):
    # what DurableCheckpoint's resolver does: wrap the strategy's load and, when "bad" is refused, load "good"
    # with the same strategy. The load wrapped is Lightning's own (unguarded), as for Lightning's stock strategies.
    stock = next(c for c in type(strategy).__mro__ if c.__module__.startswith("lightning."))
    strategy.__class__ = type("Stock", (type(strategy),), {"load_checkpoint": stock.load_checkpoint})
    def wrap(load):
        def resolving(path, weights_only=None):
            try:
                return load(path, weights_only=weights_only)
            except UnsafeCheckpointError as err:
                strategy.refused = str(err)
                return load("good", weights_only=weights_only)
        return resolving
    assert _lightning.wrap_strategy_load(strategy, wrap)


out = {}
_, ref, _, _ = fit(6)
out["ref"] = ref.losses
t, _, _, _ = fit(4)
t.save_checkpoint("good")
"""

DEEPSPEED = (
    COMMON
    + r"""
planted = plant("good", "bad", "zero_pp_rank_1_*optim_states.pt")  # rank 1's file: rank 0 must refuse too
out["planted"] = planted
_, _, out["refused"], _ = fit(6, ckpt_path="bad")
out["marker_after_refusal"] = os.path.exists("MARKER")
t, m, error, _ = fit(6, ckpt_path="bad", wrap=fallback)
out["fallback_error"], out["fallback_refused"], out["fallback_losses"] = error, t.strategy.refused, m.losses
t, m, error, out["escapes"] = fit(6, ckpt_path="bad", weights_only=False)
out["trusted_error"], out["trusted_steps"] = error, t.global_step
out["marker_after_trust"] = os.path.exists("MARKER")
t, m, error, _ = fit(6, ckpt_path="good")
out["resumed_error"], out["resumed_losses"] = error, m.losses
t, m, error, _ = fit(6, ckpt_path="good", weights_only=False)  # the strategy's own full unpickling, as before
out["trusted_good_losses"] = m.losses
t, _, _, _ = fit(4, model=Partial(functools.partial(torch.optim.SGD, lr=0.1)))
t.save_checkpoint("partial")
_, _, out["partial_refused"], _ = fit(6, ckpt_path="partial", model=Partial())
t, m, out["partial_error"], _ = fit(6, ckpt_path="partial", model=Partial(), weights_only=False)
out["partial_steps"] = t.global_step
with open(f"rank{t.global_rank}.json", "w") as f:
    json.dump(out, f)
"""
)


def _check_common(res: dict, rank: int, planted_file: str, refused_type: str) -> None:
    # a planted payload: refused on every rank, naming the file and the type; nothing ran
    assert res["refused"] is not None, "the planted checkpoint was loaded"
    assert planted_file in res["refused"] and refused_type in res["refused"], res["refused"]
    assert "nothing in it was executed" in res["refused"]
    assert res["marker_after_refusal"] is False
    # after a refusal, the same strategy loads the older checkpoint, and resumes exactly as directly
    assert res["fallback_error"] is None
    assert planted_file in res["fallback_refused"]
    assert res["resumed_error"] is None
    # bit for bit as the strategy's own (full-unpickling) load resumes; the first step as the uninterrupted run's
    assert res["fallback_losses"] == res["resumed_losses"] == res["trusted_good_losses"]
    assert res["resumed_losses"][0] == res["ref"][4]
    # weights_only=False: the user trusts the file; it loads (its payload runs), with one warning on rank 0
    assert res["trusted_error"] is None and res["trusted_steps"] == 6
    assert res["escapes"] == (1 if rank == 0 else 0)
    assert res["marker_after_trust"] is True
    # a Hydra-style hyper-parameter (functools.partial): refused by default, resumed with weights_only=False
    assert res["partial_refused"] is not None and "functools.partial" in res["partial_refused"]
    assert res["partial_error"] is None and res["partial_steps"] == 6


@pytest.mark.distributed
@pytest.mark.timeout(600)
# stage 2 in the extended tier: stage 3 reads the same weights-only path over more files (partitioned parameters)
@pytest.mark.parametrize("stage", [pytest.param(2, marks=pytest.mark.extended), 3])
def test_deepspeed_resume_is_weights_only(tmp_path: Path, stage: int) -> None:
    pytest.importorskip("deepspeed")
    run_together(DEEPSPEED, tmp_path, timeout=560, args=[f"deepspeed_stage_{stage}_cpu"]).check()
    for rank in (0, 1):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        _check_common(res, rank, res["planted"].split("/")[-1], "builtins.exec")


FSDP2 = (
    COMMON
    + r"""
if KIND == "fsdp2_sharded":
    planted = plant("good", "bad", ".metadata", how="pickle")  # the file torch reads with plain pickle
else:
    planted = plant("good", "bad", "*")
out["planted"] = planted
_, _, out["refused"], _ = fit(6, ckpt_path="bad")
out["marker_after_refusal"] = os.path.exists("MARKER")
t, m, error, _ = fit(6, ckpt_path="bad", wrap=fallback)
out["fallback_error"], out["fallback_refused"], out["fallback_losses"] = error, t.strategy.refused, m.losses
t, m, error, out["escapes"] = fit(6, ckpt_path="bad", weights_only=False)
out["trusted_error"], out["trusted_steps"] = error, t.global_step
out["marker_after_trust"] = os.path.exists("MARKER")
t, m, error, _ = fit(6, ckpt_path="good")
out["resumed_error"], out["resumed_losses"] = error, m.losses
t, m, error, _ = fit(6, ckpt_path="good", weights_only=False)  # the strategy's own full unpickling, as before
out["trusted_good_losses"] = m.losses
t, _, _, _ = fit(4, model=Partial(functools.partial(torch.optim.SGD, lr=0.1)))
t.save_checkpoint("partial")
_, _, out["partial_refused"], _ = fit(6, ckpt_path="partial", model=Partial())
t, m, out["partial_error"], _ = fit(6, ckpt_path="partial", model=Partial(), weights_only=False)
out["partial_steps"] = t.global_step
with open(f"rank{t.global_rank}.json", "w") as f:
    json.dump(out, f)
"""
)


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["fsdp2_full", "fsdp2_sharded"])
def test_fsdp2_resume_is_weights_only(tmp_path: Path, kind: str) -> None:
    run_together(FSDP2, tmp_path, timeout=560, args=[kind]).check()
    for rank in (0, 1):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        expected_type = "builtins.exec"
        _check_common(res, rank, res["planted"], expected_type)


OMEGACONF = (
    COMMON.split("out = {}")[0]
    + r"""
from omegaconf import OmegaConf


class Configured(Regression):
    def __init__(self, cfg=None):
        super().__init__(8, (16,), lr=1e-2)
        self.save_hyperparameters(cfg)


out = {}
t, _, _, _ = fit(4, model=Configured(OmegaConf.create({"lr": 0.01, "layers": [16]})))
t.save_checkpoint("omegaconf")
_, _, out["refused"], _ = fit(6, ckpt_path="omegaconf", model=Configured())
t, m, out["error"], _ = fit(6, ckpt_path="omegaconf", model=Configured(), weights_only=False)
out["steps"] = t.global_step
with open(f"rank{t.global_rank}.json", "w") as f:
    json.dump(out, f)
"""
)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_omegaconf_hyper_parameters_resume_with_weights_only_false(tmp_path: Path) -> None:
    pytest.importorskip("omegaconf")
    run_together(OMEGACONF, tmp_path, timeout=280, args=["fsdp2_full"]).check()
    for rank in (0, 1):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert res["refused"] is not None and "omegaconf" in res["refused"]
        assert res["error"] is None and res["steps"] == 6


# ------------------------------------------------------------------ the pieces, in one process


class _Payload:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (exec, ("raise SystemExit('the payload ran')",))


def test_a_payload_file_is_refused_naming_file_and_type(tmp_path: Path) -> None:
    path = tmp_path / "optim_states.pt"
    torch.save({"weights": torch.ones(2), "x": _Payload()}, path)
    with pytest.raises(UnsafeCheckpointError, match=r"optim_states\.pt.*the type builtins\.exec.*nothing in it"):
        _lightning.weights_only_file(path, _lightning.DEEPSPEED_SAFE_TYPES)


def test_the_dcp_metadata_unpickler_allows_metadata_and_refuses_the_rest(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    metadata = Metadata(
        {
            "w": TensorStorageMetadata(
                TensorProperties(dtype=torch.float16),
                torch.Size([2]),
                [ChunkStorageMetadata(torch.Size([0]), torch.Size([2]))],
            )
        },
        planner_data={"w": ("w",)},
    )
    good = tmp_path / ".metadata"
    good.write_bytes(pickle.dumps(metadata))
    loaded = _lightning.loading._restricted_unpickle(good, _lightning.DCP_METADATA_TYPES)
    assert loaded.state_dict_metadata["w"].properties.dtype == torch.float16
    metadata.planner_data["x"] = _Payload()
    good.write_bytes(pickle.dumps(metadata))
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata.*the type builtins\.exec"):
        _lightning.loading._restricted_unpickle(good, _lightning.DCP_METADATA_TYPES)


def test_the_dcp_metadata_unpickler_changes_no_allowed_class_and_allocates_no_forged_memo(tmp_path: Path) -> None:
    import pathlib
    import resource

    path = tmp_path / ".metadata"
    exists = pathlib.PosixPath.exists
    # GLOBAL pathlib.PosixPath, BUILD with (None, {"exists": None}): a setattr on the class, for the whole process
    path.write_bytes(b"\x80\x02cpathlib\nPosixPath\nN}X\x06\x00\x00\x00existsNs\x86b.")
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata.*the type builtins\.type"):
        _lightning.loading._restricted_unpickle(path, _lightning.DCP_METADATA_TYPES)
    assert pathlib.PosixPath.exists is exists
    path.write_bytes(b"\x80\x02Nr" + (2**30).to_bytes(4, "little") + b".")  # memo index 2**30: an 8 GiB C table
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert _lightning.loading._restricted_unpickle(path, _lightning.DCP_METADATA_TYPES) is None
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 100_000  # KiB


def test_every_allow_listed_type_exists() -> None:
    pytest.importorskip("deepspeed")
    names = _lightning.DEEPSPEED_SAFE_TYPES + _lightning.DCP_METADATA_TYPES
    assert [name for name in names if _lightning.loading._resolve_global(name) is None] == []


def test_a_non_tensor_item_of_a_sharded_checkpoint_is_read_weights_only(tmp_path: Path) -> None:
    import io

    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    _, planner_cls = _lightning.loading._dcp_weights_only_classes()
    planner = planner_cls(tmp_path)
    planner.set_up_planner({"lr": 0.5}, None, True)
    item = ReadItem(
        type=LoadItemType.BYTE_IO,
        dest_index=MetadataIndex("lr"),
        dest_offsets=torch.Size([0]),
        storage_index=MetadataIndex("lr"),
        storage_offsets=torch.Size([0]),
        lengths=torch.Size([0]),
    )
    value = io.BytesIO()
    torch.save(0.25, value)
    value.seek(0)
    planner.load_bytes(item, value)
    assert planner.original_state_dict["lr"] == 0.25
    value = io.BytesIO()
    torch.save(_Payload(), value)
    value.seek(0)
    with pytest.raises(UnsafeCheckpointError, match=r"\(item lr\).*the type builtins\.exec"):
        planner.load_bytes(item, value)
