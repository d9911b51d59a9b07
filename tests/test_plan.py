"""k2deploy plan: placements parsed, made and checked; bytes per device against the checkpoint layout; the
decode bound by hand; the command on a preset, a bare config.json and an artifact's manifest."""

import json

import pytest
from plan_helpers import nbytes, run_plan

from k2deploy.core.cache_format import CacheFormat
from k2deploy.core.checkpoint import layout
from k2deploy.core.checkpoint.presets import preset_config
from k2deploy.core.errors import K2Error
from k2deploy.core.manifest import FORMAT_VERSION
from k2deploy.core.placement import (DEVICES, USABLE_FRACTION, auto_placement, check_fits, format_placement,
                                parse_devices, parse_placement)
from k2deploy.core.plan import format_plan, plan
from k2deploy.core.sizes import kv_cache_bytes_per_token



@pytest.fixture(scope="module")
def k2():
    return preset_config("k2")


@pytest.fixture(scope="module")
def k2_on_two_hosts(k2):
    return plan(k2, "16xH200", hosts=2, context=131072, batch=8)


def test_k2_on_16_h200_holds_the_checkpoint_and_its_cache(k2, k2_on_two_hosts):
    info = k2_on_two_hosts
    rows = info["per_device"]
    checkpoint = nbytes(layout.all_tensors(k2))
    assert sum(r["weights_bytes"] for r in rows) == info["totals"]["weights_bytes"] == checkpoint
    per_token = CacheFormat.for_config(k2, "fp8").bytes_per_token_per_layer
    assert per_token == 656 == kv_cache_bytes_per_token(k2)["fp8_latent"]  # core/sizes.py's figure
    assert sum(r["cache_bytes"] for r in rows) == info["totals"]["cache_bytes"] == 8 * 131072 * 61 * 656
    for r in rows:
        a, b = r["layers"]
        layers = nbytes(s for i in range(a, b) for s in layout.layer_tensors(k2, i))
        ends = nbytes(layout.embedding_tensors(k2)) * (a == 0) + nbytes(layout.head_tensors(k2)) * (b == 61)
        assert r["weights_bytes"] == layers + ends
        assert r["cache_bytes"] == 8 * 131072 * (b - a) * 656
        assert r["total_bytes"] == r["weights_bytes"] + r["cache_bytes"] + r["activation_bytes"]
        assert r["capacity_bytes"] == int(141e9 * USABLE_FRACTION) and r["total_bytes"] <= r["capacity_bytes"]
        assert r["free_bytes"] == r["capacity_bytes"] - r["total_bytes"]


def test_k2_on_16_h200_is_contiguous_balanced_and_split_over_the_hosts(k2_on_two_hosts):
    info = k2_on_two_hosts
    layers = [tuple(r["layers"]) for r in info["per_device"]]
    assert layers[0][0] == 0 and layers[-1][1] == 61
    assert all(prev[1] == nxt[0] for prev, nxt in zip(layers, layers[1:]))
    assert max(b - a for a, b in layers) == 4  # ceil(61 / 16): no device holds more than it must
    assert [(r["host"], r["device"]) for r in info["per_device"]] == \
        [(i // 8, f"cuda:{i % 8}") for i in range(16)]
    assert parse_placement(info["placement"]["text"], 61) == parse_placement(
        ",".join(f"{a}:{b}@h{i // 8}/cuda:{i % 8}" for i, (a, b) in enumerate(layers)), 61)


def test_one_boundary_crosses_the_hosts_carrying_the_float32_hidden_state(k2_on_two_hosts):
    info = k2_on_two_hosts
    assert len(info["boundaries"]) == 15
    assert all(b["bytes_per_token"] == 7168 * 4 and b["bytes_per_step"] == 7168 * 4 * 8 for b in info["boundaries"])
    crossing = [b for b in info["boundaries"] if b["crosses_hosts"]]
    assert len(crossing) == 1 and crossing[0]["from"] == "h0/cuda:7" and crossing[0]["to"] == "h1/cuda:0"
    assert info["boundary_bytes_per_token"] == info["host_link_bytes_per_token"] == 7168 * 4


def test_activations_follow_the_stated_estimate(k2_on_two_hosts):
    # batch x chunk 512 x float32 x (4 hidden buffers + widest intermediate: 2 x 2048 x (8 chosen + 1 shared)
    # = 2 x 18432 dense = 36864), plus the attention's workspace (4 score tensors of at most 16 MiB, whatever the
    # context), plus batch x vocab float32 logits on the last stage
    rows = k2_on_two_hosts["per_device"]
    base = 8 * 512 * 4 * (4 * 7168 + 36864) + 4 * 16 * 2**20
    assert [r["activation_bytes"] for r in rows] == [base] * 15 + [base + 8 * 163840 * 4]


def test_plan_command_prints_json_and_a_table(capsys, k2_on_two_hosts):
    run_plan("--preset", "k2", "--devices", "16xH200", "--hosts", "2", "--context", "131072", "--batch", "8", "--json")
    printed = json.loads(capsys.readouterr().out)
    assert [r["weights"] for r in printed.pop("weights_compared")] == ["stored", "int8", "int4"]
    assert printed == json.loads(json.dumps(k2_on_two_hosts))
    run_plan("--preset", "k2", "--devices", "16xH200", "--hosts", "2", "--context", "131072", "--batch", "8")
    table = capsys.readouterr().out
    assert k2_on_two_hosts["placement"]["text"] in table
    assert "h0/cuda:7 -> h1/cuda:0 before layer" in table
    assert sum(1 for line in table.splitlines() if line.split()[:1] and line.split()[0].isdigit()) == 16


def test_plan_command_reads_a_checkpoint_config_without_weights(tmp_path, capsys, k2):
    (tmp_path / "config.json").write_text(json.dumps(k2.to_dict()))
    run_plan(str(tmp_path), "--devices", "16xH200", "--json")
    from_config = json.loads(capsys.readouterr().out)
    run_plan("--preset", "k2", "--devices", "16xH200", "--json")
    assert from_config == json.loads(capsys.readouterr().out)
    assert from_config["context"] == 131072 and from_config["kv_cache"]["format"] == "fp8"


def test_plan_command_takes_the_cache_format_from_an_artifact(tmp_path, capsys):
    config = preset_config("tiny")
    manifest = {"format": "k2deploy-artifact", "format_version": FORMAT_VERSION, "files": {}, "model_config": config.to_dict(),
                "kv_cache": CacheFormat.for_config(config, "int8").description(),
                "graphs": {"embed": None, "head": None, "layers": [], "layer_range": [0, 0]}}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    run_plan(str(tmp_path), "--devices", "1xH200", "--json")
    info = json.loads(capsys.readouterr().out)
    assert info["kv_cache"] == {"format": "int8", "bytes_per_token_per_layer": 64 + 4 + 2 * 16}
    with pytest.raises(K2Error, match="reads and writes the int8 cache; drop --kv-cache"):
        run_plan(str(tmp_path), "--devices", "1xH200", "--kv-cache", "fp8")


@pytest.mark.parametrize("argv, problem", [
    ([], "or --preset"),
    (["--preset", "tiny", "."], "one of them"),
])
def test_plan_command_needs_one_source(argv, problem):
    with pytest.raises(K2Error, match=problem):
        run_plan(*argv, "--devices", "1xH200")


def test_plan_command_refuses_a_folder_that_is_neither(tmp_path):
    with pytest.raises(K2Error, match="neither an artifact .* nor a checkpoint"):
        run_plan(str(tmp_path), "--devices", "1xH200")


@pytest.mark.parametrize("text", ["0:31@cuda:0,31:61@cuda:1", "0:61@cpu", "0:10@h0/cuda:0,10:61@h1/cuda:0",
                                  "0:1@cuda:0,1:2@cuda:1,2:61@cpu"])
def test_placement_text_round_trips(text):
    stages = parse_placement(text, 61)
    assert format_placement(stages) == text
    assert [s.first for s in stages] == [True] + [False] * (len(stages) - 1)
    assert [s.last for s in stages] == [False] * (len(stages) - 1) + [True]


def test_placement_ranges_may_come_in_any_order():
    stages = parse_placement("31:61@cuda:1,0:31@cuda:0", 61)
    assert [(s.start, s.stop, s.device) for s in stages] == [(0, 31, "cuda:0"), (31, 61, "cuda:1")]


@pytest.mark.parametrize("text, problem", [
    ("0:30@cuda:0,31:61@cuda:1", "layers 30:31 are on no device"),
    ("1:61@cuda:0", "layers 0:1 are on no device"),
    ("0:60@cuda:0", "layers 60:61 are on no device"),
    ("0:32@cuda:0,30:61@cuda:1", "layers 30:32 are on two devices"),
    ("0:31@cuda:0,31:62@cuda:1", "31:62 goes past the model's 61 layers"),
    ("0:31@cuda:0,31:31@cuda:1,31:61@cuda:2", "31:31 holds no layers"),
    ("0:30@cuda:0,30:61@cuda:0", "h0/cuda:0 holds both 0:30 and 30:61"),
    ("0:30@h1/cuda:0,30:61@h1/cuda:0", "h1/cuda:0 holds both"),
    ("0:61", "'0:61' is not START:STOP@DEVICE"),
    ("0:61@gpu0", "'0:61@gpu0' is not START:STOP@DEVICE"),
    ("zero:61@cpu", "is not START:STOP@DEVICE"),
    ("", "'' is not START:STOP@DEVICE"),
])
def test_placement_errors_name_the_problem(text, problem):
    with pytest.raises(K2Error, match=problem) as caught:
        parse_placement(text, 61)
    assert str(caught.value).startswith(f"--placement {text}: ") and "\n" not in str(caught.value)


def test_devices_parse_case_insensitively_and_list_the_known_kinds():
    assert parse_devices("16xH200") == (DEVICES["H200"], 16)
    assert parse_devices("8xmi300x") == (DEVICES["MI300X"], 8)
    kind, count = parse_devices("2x512GB@0.2TB/s")
    assert (kind.memory_bytes, kind.bandwidth_bytes_per_s, count) == (512e9, 0.2e12, 2)
    for text in ("16xH300", "H200", "0xH200", "16x"):
        with pytest.raises(K2Error, match="H200, H100, B200, A100, MI300X, L40S"):
            parse_devices(text)


def test_k2_on_two_h200_says_how_many_devices_it_needs(k2):
    with pytest.raises(K2Error, match=r"--devices 2xH200: needs 1\.03 TB .* at least 9 such devices"):
        plan(k2, "2xH200")


def test_a_cache_too_long_for_the_devices_says_which_context_fits(k2):
    with pytest.raises(K2Error, match=r"at least 13 such devices; at --context (\d+) it fits on 12 x H200") as caught:
        plan(k2, "12xH200", context=131072, batch=64)
    fits = int(str(caught.value).rsplit("--context ", 1)[1].split()[0])
    assert plan(k2, "12xH200", context=fits, batch=64)["totals"]["total_bytes"] > 0
    with pytest.raises(K2Error):
        plan(k2, "12xH200", context=fits + 1, batch=64)


def test_an_explicit_placement_that_does_not_fit_names_the_stage_and_one_that_does(k2):
    with pytest.raises(K2Error, match=r"stage 0 \(layers 0:10 on h0/cuda:0\) needs 157\.\d+ GB, more than the "
                                      r"126\.90 GB .*; --placement 0:4@cuda:0,.*,58:61@cuda:15 fits"):
        plan(k2, "16xH200", placement="0:10@cuda:0,10:61@cuda:1")


@pytest.mark.parametrize("placement, problem", [
    ("0:30@cuda:0,30:61@h2/cuda:0", "h2/cuda:0 is on host 2, but --hosts 2 gives hosts h0 to h1"),
    ("0:30@cuda:0,30:61@cuda:8", "h0/cuda:8 is not one of the 8 H200 per host"),
])
def test_an_explicit_placement_uses_only_the_devices_given(k2, placement, problem):
    with pytest.raises(K2Error, match=problem):
        plan(k2, "16xH200", hosts=2, placement=placement)


def test_tiny_on_cpu_by_explicit_placement():
    tiny = preset_config("tiny")
    info = plan(tiny, "1x64GB@100GB/s", context=1000, batch=2, placement="0:3@cpu")
    (row,) = info["per_device"]
    assert (row["device"], row["host"], row["layers"]) == ("cpu", 0, [0, 3])
    assert row["weights_bytes"] == nbytes(layout.all_tensors(tiny))
    assert row["capacity_bytes"] == int(64e9 * USABLE_FRACTION)
    assert info["boundaries"] == [] and info["host_link_bytes_per_token"] == 0


def test_decode_bound_of_each_stage_is_its_bytes_over_the_bandwidth():
    tiny = preset_config("tiny")  # 16 experts, top-4: batch 2 reads 16 x (1 - (1 - 4/16)^2) = 7 of them
    batch, context = 2, 100
    info = plan(tiny, "2xH200", context=context, batch=batch, placement="0:1@cuda:0,1:3@cuda:1")
    cache = batch * context * CacheFormat.for_config(tiny, "fp8").bytes_per_token_per_layer  # per layer
    embedding_rows = batch * 192 * 2
    stage0 = embedding_rows + nbytes(layout.layer_tensors(tiny, 0)) + cache
    stage1 = nbytes(layout.head_tensors(tiny)) + 2 * cache
    for i in (1, 2):
        specs = layout.layer_tensors(tiny, i)
        stage1 += nbytes(s for s in specs if ".experts." not in s.name)
        stage1 += 7 * nbytes(s for s in specs if ".experts.0." in s.name)
    seconds = [stage0 / 4.8e12, stage1 / 4.8e12]
    assert [r["decode_read_bytes"] for r in info["per_device"]] == [stage0, stage1]
    assert [r["decode_ms"] for r in info["per_device"]] == pytest.approx([1e3 * s for s in seconds])
    assert info["decode_ms_per_token"] == pytest.approx(1e3 * sum(seconds))
    assert info["tokens_per_s"] == pytest.approx(batch / max(seconds))
    assert info["tokens_per_s_in_turn"] == pytest.approx(batch / sum(seconds))


def test_one_sequence_is_not_promised_pipelined_throughput():
    info = plan(preset_config("tiny"), "2xH200", context=100, batch=1, placement="0:1@cuda:0,1:3@cuda:1")
    assert info["tokens_per_s_in_turn"] == pytest.approx(1e3 / info["decode_ms_per_token"])
    line = next(line for line in format_plan(info).splitlines() if "tokens/s" in line)
    assert line.split()[2] == f"{info['tokens_per_s_in_turn']:,.0f}"
    assert "pipelining needs at least 2 sequences in flight" in line


def test_auto_placement_balances_and_refuses_what_cannot_fit():
    stages = auto_placement([10] * 10, 0, 0, 4, 2, 100)
    assert stages[0].start == 0 and stages[-1].stop == 10 and all(a.stop == b.start for a, b in zip(stages, stages[1:]))
    assert sorted(s.layers for s in stages) == [2, 2, 3, 3]
    assert [(s.host, s.device) for s in stages] == [(0, "cuda:0"), (0, "cuda:1"), (1, "cuda:0"), (1, "cuda:1")]
    extras = auto_placement([10] * 6, 20, 0, 2, 1, 100)  # the embedding's bytes count: 40 and 40, not 50 and 30
    assert [(s.start, s.stop) for s in extras] == [(0, 2), (2, 6)]
    with pytest.raises(K2Error, match="layer 2 alone needs 150 B .* more than the 100 B"):
        auto_placement([10, 10, 150, 10], 0, 0, 2, 1, 100)
    with pytest.raises(K2Error, match="layer 0 with the embedding alone"):
        auto_placement([10, 10], 95, 0, 2, 1, 100)
    with pytest.raises(K2Error, match="use at most 3 devices"):
        auto_placement([10] * 3, 0, 0, 4, 1, 100)
    with pytest.raises(K2Error, match="4 devices do not split evenly over 3 hosts"):
        auto_placement([10] * 8, 0, 0, 4, 3, 100)


def test_check_fits_names_the_stage_that_does_not():
    stages = parse_placement("0:2@cuda:0,2:4@cuda:1", 4)
    check_fits(stages, [100, 100], 100)
    with pytest.raises(K2Error, match=r"stage 1 \(layers 2:4 on h0/cuda:1\) needs 2.50 kB, more than the 2.00 kB "
                                      r".* shed 500 B"):
        check_fits(stages, [100, 2500], 2000)


@pytest.mark.parametrize("kwargs, problem", [
    (dict(context=4097), "--context 4097: choose 1 to the model's 4096 positions"),
    (dict(batch=0), "--batch must be at least 1"),
    (dict(hosts=0), "--hosts must be at least 1"),
    (dict(cache_format="fp4"), "unknown latent cache format 'fp4'"),
])
def test_plan_refuses_bad_arguments(kwargs, problem):
    with pytest.raises(K2Error, match=problem):
        plan(preset_config("tiny"), "1xH200", **kwargs)
