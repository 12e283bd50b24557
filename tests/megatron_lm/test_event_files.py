"""TensorBoard event files: the reader on a file written by torch.utils.tensorboard, round trips of
the writer, corruption, and the compare tool on event directories."""

import base64
import math
import random
import struct

import pytest

from megatron_tsp.megatron_lm import compare
from megatron_tsp.megatron_lm import event_files as E

# Written by torch 2.13's torch.utils.tensorboard.SummaryWriter (tensorboard 2.21) with
# add_text("seq_length", "128"), add_text("world_size", "2"), add_scalar("lm loss", 6.9384, 1),
# add_scalar("lm loss", 6.25, 2), add_scalar("iteration-time", 0.125, 2),
# add_scalar("throughput", 12.5, 2), add_scalar("mem-max-allocated-bytes", 3221225472, 2),
# add_scalar("grad-norm", 1.5, 2, new_style=True) (a float tensor instead of simple_value).
SUMMARY_WRITER_FILE = base64.b64decode(
    "".join(
        (
            "SAAAAAAAAAD+kkidCVnRvTtFxNpBGg1icmFpbi5FdmVudDoyUi4KLHRlbnNvcmJvYXJkLnN1bW1hcnkud3JpdGVyLmV2"
            "ZW50X2ZpbGVfd3JpdGVyPVaqCT8AAAAAAAAAUWV2YQlR2707RcTaQSo0CjIKF3NlcV9sZW5ndGgvdGV4dF9zdW1tYXJ5"
            "Qg0IBxIEEgIIAUIDMTI4SggKBgoEdGV4dKI3Tas9AAAAAAAAAGBJ8ewJ8Nu9O0XE2kEqMgowChd3b3JsZF9zaXplL3Rl"
            "eHRfc3VtbWFyeUILCAcSBBICCAFCATJKCAoGCgR0ZXh042Mzwh0AAAAAAAAAYC/fIwnB3L07RcTaQRABKhAKDgoHbG0g"
            "bG9zcxVfB95A+6Wvah0AAAAAAAAAYC/fIwkG3b07RcTaQRACKhAKDgoHbG0gbG9zcxUAAMhAVSDNaCQAAAAAAAAAQiuA"
            "TQk63b07RcTaQRACKhcKFQoOaXRlcmF0aW9uLXRpbWUVAAAAPrbmr8AgAAAAAAAAACntqVAJat29O0XE2kEQAioTChEK"
            "CnRocm91Z2hwdXQVAABIQTQJX5ktAAAAAAAAADxBivsJtd29O0XE2kEQAiogCh4KF21lbS1tYXgtYWxsb2NhdGVkLWJ5"
            "dGVzFQAAQE818vsNMQAAAAAAAACdg4PpCSrevTtFxNpBEAIqJAoiCglncmFkLW5vcm1CCAgBKgQAAMA/SgsKCQoHc2Nh"
            "bGFyczDrHRE="
        )
    )
)


def test_reads_summary_writer_file(tmp_path):
    path = tmp_path / "events.out.tfevents.1796281582.vm.22990.0"
    path.write_bytes(SUMMARY_WRITER_FILE)
    run = E.read_run(str(tmp_path))
    assert run.texts == {"seq_length": "128", "world_size": "2"}
    assert run.series("lm loss") == [
        (1, struct.unpack("<f", struct.pack("<f", 6.9384))[0]),
        (2, 6.25),
    ]
    assert run.series("iteration-time") == [(2, 0.125)]
    assert run.series("throughput") == [(2, 12.5)]
    assert run.series("mem-max-allocated-bytes") == [(2, 3221225472.0)]
    assert run.series("grad-norm") == [(2, 1.5)]
    first = E.parse_event(next(E.iter_records(str(path))))
    assert first.file_version == "brain.Event:2"


def test_crc32c_known_value():
    # RFC 3720 test vector: 32 bytes of zeros
    assert E.crc32c(bytes(32)) == 0x8A9136AA
    assert E.crc32c(b"123456789") == 0xE3069283


def test_writer_round_trip(tmp_path):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    steps = sorted(rng.sample(range(1, 10_000), 20))
    values = [rng.uniform(-1e3, 1e3) for _ in steps]
    events = [
        E.encode_event(step=s, wall_time=1.5e9 + s, scalars=[("lm loss", v)])
        for s, v in zip(steps, values)
    ]
    events.append(E.encode_event(step=0, texts=[("seq_length", str(rng.randint(1, 1 << 17)))]))
    path = tmp_path / "events.out.tfevents.1.host"
    E.write_events(str(path), events)
    run = E.read_run(str(path))
    expected = [(s, struct.unpack("<f", struct.pack("<f", v))[0]) for s, v in zip(steps, values)]
    assert run.series("lm loss") == expected, seed
    assert int(run.texts["seq_length"]) > 0


def test_corrupt_and_truncated_files(tmp_path):
    path = tmp_path / "events.out.tfevents.2.host"
    E.write_events(
        str(path), [E.encode_event(step=i, scalars=[("lm loss", float(i))]) for i in range(3)]
    )
    data = bytearray(path.read_bytes())
    path.write_bytes(bytes(data[:-5]))  # a writer still running: last record incomplete
    assert [s for s, _ in E.read_run(str(path)).series("lm loss")] == [0, 1]
    data[-6] ^= 0xFF  # flip a byte inside the last record's payload
    path.write_bytes(bytes(data))
    with pytest.raises(E.EventFileError, match="checksum"):
        E.read_run(str(path))
    assert [s for s, _ in E.read_run(str(path), check_crc=False).series("lm loss")] == [0, 1, 2]
    with pytest.raises(E.EventFileError, match="no TensorBoard event files"):
        E.read_run(str(tmp_path / "missing"))


def _megatron_like_dir(root, losses, seconds, tflops, mem_bytes, seq=4096, world=8, gbs=8):
    root.mkdir()
    events = [E.encode_event(texts=[("seq_length", str(seq)), ("world_size", str(world))])]
    for it, loss in enumerate(losses, start=1):
        scalars = [("lm loss", loss), ("batch-size", gbs), ("mem-max-allocated-bytes", mem_bytes)]
        if it > 1:  # Megatron skips the first iteration's timers
            scalars += [("iteration-time", seconds[it - 1]), ("throughput", tflops[it - 1])]
        events.append(E.encode_event(step=it, scalars=scalars))
    E.write_events(str(root / "events.out.tfevents.3.host"), events)


def test_compare_reads_event_dirs_and_logs_together(tmp_path, capsys):
    _megatron_like_dir(
        tmp_path / "tsp", [10.5, 9.0, 8.0], [0.9, 0.4, 0.6], [1.0, 100.0, 120.0], 30 * 2**30
    )
    run = compare.parse_run(str(tmp_path / "tsp"), "tsp")
    assert run.iterations == [1, 2, 3] and run.loss == [10.5, 9.0, 8.0]
    assert math.isnan(run.ms_per_iter[0]) and run.ms_per_iter[1:] == pytest.approx([400.0, 600.0])
    assert run.max_allocated_mb == {7: 30 * 1024.0} and run.global_batch == [8, 8, 8]
    s = compare.summarize(run, skip=1)
    assert s["ms/iter"] == pytest.approx(500.0) and s["TFLOP/s/GPU"] == pytest.approx(110.0)
    assert s["tokens/s"] == pytest.approx(8 * 4096 / 0.5)
    log = tmp_path / "tp.log"
    log.write_text(
        "".join(
            f" [2026-01-01] iteration {i:8d}/{3:8d} | elapsed time per iteration (ms): 500.0 | "
            f"global batch size: {8:5d} | lm loss: {loss:.6E} | grad norm: 1.0 |\n"
            for i, loss in enumerate([10.5, 9.5, 8.5], start=1)
        )
    )
    assert compare.main([f"tsp={tmp_path / 'tsp'}", f"tp={log}"]) == 0
    out = capsys.readouterr().out
    assert "lm loss at iteration 1: tp - tsp = +0.000e+00" in out
    empty = tmp_path / "empty"
    empty.mkdir()
    E.write_events(str(empty / "events.out.tfevents.4.host"), [])
    assert compare.main([f"x={empty}"]) == 2
