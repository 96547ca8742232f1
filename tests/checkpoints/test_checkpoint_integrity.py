"""A checkpoint damaged on disk never resumes silently: every record is checked against its CRC-32 (an
explicit `ckpt_path` is an error naming the file and the record, `last` falls back to the newest intact
checkpoint), and restored weights that hold NaN or inf stop a resumed run before its first step."""

import struct
import zipfile

import pytest
import torch
from test_checkpointing import fit

from exgrpo_pl.checkpoints.integrity import NonFiniteWeightsError, check_loadable, incomplete_reason
from exgrpo_pl.checkpoints.saving import AtomicCheckpointIO, SafeModelCheckpoint, mark_complete
from exgrpo_pl.cli import main

WEIGHT = "policy.model.layers.0.mlp.gate_proj.weight"


def flip_exponent_bit(path, record=None) -> str:
    """Flips the top exponent bit of the first float32 of a tensor record of `path` (the largest one
    unless `record` is given), in place, as a disk error would; returns the record's name. A weight of
    about 1e-2 becomes about 1e36: finite, so only the CRC tells."""
    with zipfile.ZipFile(path) as archive:
        tensors = [info for info in archive.infolist() if "/data/" in info.filename]
        info = max(tensors, key=lambda i: i.file_size) if record is None else archive.getinfo(record)
    with open(path, "r+b") as handle:
        handle.seek(info.header_offset + 26)
        name_length, extra_length = struct.unpack("<HH", handle.read(4))
        start = info.header_offset + 30 + name_length + extra_length
        handle.seek(start + 3)  # little-endian float32: the sign and the top exponent bits
        byte = handle.read(1)[0]
        handle.seek(start + 3)
        handle.write(bytes([byte ^ 0x40]))
    return info.filename


def test_a_flipped_bit_in_any_tensor_record_is_found_and_named(tmp_path):
    path = tmp_path / "a.ckpt"
    torch.save({"state_dict": {"w": torch.full((64, 64), 0.01), "b": torch.ones(3)}}, path)
    assert incomplete_reason(str(path)) is None
    record = flip_exponent_bit(path)
    assert torch.load(path, weights_only=True)["state_dict"]["w"].max() > 1e30  # torch itself loads it
    reason = incomplete_reason(str(path))
    assert reason is not None and f"record {record!r} fails its CRC-32 check" in reason


def test_a_file_changed_after_its_check_is_checked_again(tmp_path):
    path = tmp_path / "a.ckpt"
    torch.save({"w": torch.full((256,), 0.5)}, path)
    assert incomplete_reason(str(path)) is None  # now remembered as intact
    flip_exponent_bit(path)
    assert "fails its CRC-32 check" in incomplete_reason(str(path))


def test_a_deepspeed_folder_is_intact_only_when_every_shard_is(tmp_path):
    folder = tmp_path / "ds.ckpt"
    (folder / "checkpoint").mkdir(parents=True)
    shard = folder / "checkpoint" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt", shard.name):
        torch.save({"w": torch.full((128,), 0.25)}, folder / "checkpoint" / name)
    (folder / "latest").write_text("checkpoint")
    mark_complete(str(folder))
    assert incomplete_reason(str(folder)) is None
    flip_exponent_bit(shard)
    reason = incomplete_reason(str(folder))
    assert reason.startswith("checkpoint/zero_pp_rank_1_mp_rank_00_optim_states.pt: record")


def deepspeed_folder(path, names) -> None:
    """A DeepSpeed checkpoint folder (tag "checkpoint") holding `names`, marked complete."""
    (path / "checkpoint").mkdir(parents=True)
    for name in names:
        torch.save({"w": torch.ones(4)}, path / "checkpoint" / name)
    (path / "latest").write_text("checkpoint")
    mark_complete(str(path))


ZERO2 = ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
ZERO3_TWO_RANKS = [
    f"zero_pp_rank_{rank}_mp_rank_00_{kind}_states.pt" for rank in (0, 1) for kind in ("model", "optim")
]


@pytest.mark.parametrize(
    ("names", "gone"),
    [
        (ZERO2, "mp_rank_00_model_states.pt"),  # the marker is there, DeepSpeed's own assert would fail
        (["mp_rank_00_model_states.pt", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"], None),
        (ZERO3_TWO_RANKS, "zero_pp_rank_1_mp_rank_00_model_states.pt"),
        (ZERO3_TWO_RANKS, "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
    ],
)
def test_a_deepspeed_folder_without_a_file_deepspeed_loads_is_incomplete_naming_it(tmp_path, names, gone):
    deepspeed_folder(tmp_path / "ds.ckpt", [name for name in names if name != gone])
    reason = incomplete_reason(str(tmp_path / "ds.ckpt"))
    # the bf16 case lacks rank 0's optimizer states, named after the rank 1 file that is there
    expected = gone or "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    assert reason is not None and reason.startswith(f"checkpoint/{expected} is missing")
    with pytest.raises(
        ValueError, match=rf"ds\.ckpt: not a complete, intact checkpoint \(checkpoint/{expected}"
    ):
        check_loadable(tmp_path / "ds.ckpt", "--ckpt_path")


def test_a_complete_deepspeed_folder_of_either_stage_is_intact(tmp_path):
    for index, names in enumerate([ZERO2, ZERO3_TWO_RANKS]):
        deepspeed_folder(tmp_path / f"{index}.ckpt", names)
        assert incomplete_reason(str(tmp_path / f"{index}.ckpt")) is None


@pytest.fixture
def saved(tmp_path, tiny_model_dir):
    """Checkpoints of steps 1, 2 and 3 of a tiny run, and the trainer's directory."""
    directory = tmp_path / "ckpts"
    fit(tmp_path, tiny_model_dir, [SafeModelCheckpoint(directory, every_n_train_steps=1, save_top_k=-1)])
    return directory


def test_an_explicit_corrupt_ckpt_path_stops_the_cli_naming_file_and_record(saved, tmp_path):
    path = saved / "epoch=0-step=3.ckpt"
    record = flip_exponent_bit(path)
    expected = rf"step=3\.ckpt: not a complete, intact checkpoint \(record '{record}'"
    with pytest.raises(ValueError, match=expected):
        main(["fit", "--ckpt_path", str(path), f"--trainer.default_root_dir={tmp_path}"])


def test_trainer_fit_on_a_corrupt_file_names_it_and_takes_no_step(saved, tmp_path, tiny_model_dir):
    path = saved / "epoch=0-step=3.ckpt"
    record = flip_exponent_bit(path)
    with pytest.raises(RuntimeError, match=rf"step=3\.ckpt cannot be resumed from \(record '{record}'"):
        fit(tmp_path, tiny_model_dir, [], str(path), max_steps=4)
    with pytest.raises(RuntimeError, match="fails its CRC-32 check"):
        AtomicCheckpointIO().load_checkpoint(path)


def test_last_falls_back_to_the_newest_intact_checkpoint_with_a_warning(saved, tmp_path, tiny_model_dir):
    flip_exponent_bit(saved / "epoch=0-step=3.ckpt")
    with pytest.warns(UserWarning, match=r"skipping incomplete or corrupt .*step=3\.ckpt \(record .*CRC-32"):
        trainer = fit(tmp_path, tiny_model_dir, [SafeModelCheckpoint(saved, every_n_train_steps=1)], "last",
                      max_steps=4)  # fmt: skip
    assert trainer.ckpt_path == str(saved / "epoch=0-step=2.ckpt") and trainer.global_step == 4


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_restored_weights_that_are_not_finite_stop_before_the_first_step(
    saved, tmp_path, tiny_model_dir, value
):
    checkpoint = torch.load(saved / "epoch=0-step=3.ckpt", weights_only=True)
    checkpoint["state_dict"][WEIGHT][0, 0] = value  # saved whole: its CRCs are right, its weight is not
    torch.save(checkpoint, tmp_path / "inf.ckpt")
    steps = []

    class CountsSteps(SafeModelCheckpoint):
        def on_train_batch_start(self, *args):
            steps.append(1)

    with pytest.raises(NonFiniteWeightsError, match=rf"inf\.ckpt hold NaN or inf \(parameter '{WEIGHT}'\)"):
        fit(
            tmp_path,
            tiny_model_dir,
            [CountsSteps(tmp_path / "after")],
            str(tmp_path / "inf.ckpt"),
            max_steps=5,
        )
    assert steps == [] and not (tmp_path / "after").exists()
