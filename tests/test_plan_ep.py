"""plan --parallel ep: the expert shards, bytes per device, all-to-all and decode bound against hand formulas for
`k2` and `tiny`; the command's side by side with the pipeline; what it refuses."""

import json
import math

import pytest
from plan_helpers import nbytes, run_plan

from k2deploy.core.checkpoint import layout
from k2deploy.core.checkpoint.presets import preset_config
from k2deploy.core.errors import K2Error
from k2deploy.core.expert_parallel import expert_parallel, shards
from k2deploy.core.plan import plan

MIB = 2**20


@pytest.fixture(scope="module")
def k2():
    return preset_config("k2")


def test_experts_split_evenly_and_the_first_devices_take_the_remainder():
    assert shards(384, 16) == [24] * 16
    assert shards(384, 5) == [77] * 4 + [76]  # ceil(384 / 5) = 77 on four devices, 76 on the fifth
    assert shards(16, 3) == [6, 5, 5]


def k2_replicated(k2) -> int:
    """Every tensor but the routed experts: attention, norms, dense layer, routers, shared experts, embedding, head."""
    return nbytes(s for s in layout.all_tensors(k2) if ".mlp.experts." not in s.name)


def k2_expert(k2) -> int:
    return nbytes(layout.mlp(k2, "model.layers.1.mlp.experts.0", 2048))


@pytest.mark.parametrize("batch", [1, 64])
def test_k2_on_16_h200_bytes_per_device(k2, batch):
    info = expert_parallel(k2, "16xH200", hosts=2, context=131072, batch=batch)
    d = info["per_device"]
    local = math.ceil(batch / 16)  # 1 sequence at batch 1, 4 at batch 64
    assert d["sequences"] == local and d["experts_per_moe_layer"] == 24 == info["experts"]["per_device"]
    assert d["replicated_bytes"] == k2_replicated(k2)
    assert d["expert_shard_bytes"] == 24 * 60 * k2_expert(k2) == 24 * 60 * 44_050_944
    assert d["cache_bytes"] == local * 131072 * 61 * 656
    # the activations of its own sequences (plan's estimate, logits included) + the all-to-all's float32 buffers
    own = local * 512 * 4 * (4 * 7168 + 36864) + 4 * 16 * MIB + local * 163840 * 4
    assert d["activation_bytes"] == own + 2 * batch * 512 * 7168 * 4
    parts = ("replicated_bytes", "expert_shard_bytes", "cache_bytes", "activation_bytes")
    assert d["total_bytes"] == sum(d[part] for part in parts)
    assert d["free_bytes"] == int(141e9 * 0.9) - d["total_bytes"] > 0


def test_k2_all_to_all_bytes_per_token_per_moe_layer(k2):
    a = expert_parallel(k2, "16xH200", hosts=2, context=4096)["all_to_all"]
    # a token's 8 experts are 8 distinct of 384; a device of 24 holds none with probability C(360, 8) / C(384, 8)
    touched = 16 * (1 - math.comb(360, 8) / math.comb(384, 8))
    assert a["devices_touched_per_token"] == pytest.approx(touched) and 6.4 < touched < 6.6
    assert a["remote_devices_per_token"] == pytest.approx(touched * 15 / 16)  # its own device is any of the 16
    assert a["bytes_per_token_per_moe_layer"] == pytest.approx(2 * 7168 * 4 * touched * 15 / 16)  # float32, both ways
    assert a["host_link_bytes_per_token_per_moe_layer"] == pytest.approx(2 * 7168 * 4 * touched * 8 / 16)
    assert a["hidden_dtype"] == "float32"
    one_host = expert_parallel(k2, "16xH200", hosts=1, context=4096)["all_to_all"]
    assert one_host["host_link_bytes_per_token_per_moe_layer"] == 0


@pytest.mark.parametrize("batch", [1, 64])
def test_k2_decode_bound_at_batch_1_and_64(k2, batch):
    info = expert_parallel(k2, "16xH200", hosts=2, context=131072, batch=batch)
    local = math.ceil(batch / 16)
    experts = 24 * (1 - (1 - 8 / 384) ** batch)  # its shard's distinct experts that the batch's 8 x B choices touch
    assert info["experts_read_per_moe_layer"] == pytest.approx(experts)
    embedding = nbytes(layout.embedding_tensors(k2))
    read = (k2_replicated(k2) - embedding + local * 7168 * 2 + experts * 60 * k2_expert(k2)
            + local * 131072 * 61 * 656)
    assert info["decode_read_bytes_per_step"] == round(read)
    touched = 16 * (1 - math.comb(360, 8) / math.comb(384, 8))
    within, across = 2 * 7168 * 4 * touched * 7 / 16, 2 * 7168 * 4 * touched * 8 / 16
    exchange = 60 * local * max(within / 450e9, across / 50e9)  # NVLink 450 GB/s a way, 50 GB/s between hosts
    step = read / 4.8e12 + exchange
    assert info["all_to_all"]["ms_per_step"] == pytest.approx(1e3 * exchange)
    assert info["decode_ms_per_token"] == pytest.approx(1e3 * step)
    assert info["tokens_per_s"] == pytest.approx(batch / step)


def test_tiny_with_uneven_shards_by_hand():
    tiny = preset_config("tiny")  # 16 experts top-4 over 3 devices: 6, 5, 5; one host
    info = expert_parallel(tiny, "3xH200", context=100, batch=2, link=100e9)
    assert info["experts"] == {"per_device": 6, "devices_with_one_fewer": 2,
                               "expert_bytes": nbytes(layout.mlp(tiny, "e", 96))}
    touched = (1 - math.comb(10, 4) / math.comb(16, 4)) + 2 * (1 - math.comb(11, 4) / math.comb(16, 4))
    a = info["all_to_all"]
    assert a["bytes_per_token_per_moe_layer"] == pytest.approx(2 * 192 * 4 * touched * 2 / 3)
    experts = 6 * (1 - (1 - 4 / 16) ** 2)
    replicated = nbytes(s for s in layout.all_tensors(tiny) if ".mlp.experts." not in s.name)
    read = (replicated - 1024 * 192 * 2 + 192 * 2 + experts * 2 * nbytes(layout.mlp(tiny, "e", 96))
            + 100 * 3 * info["kv_cache"]["bytes_per_token_per_layer"])
    step = read / 4.8e12 + 2 * 1 * a["bytes_per_token_per_moe_layer"] / 100e9
    assert info["decode_ms_per_token"] == pytest.approx(1e3 * step)


def test_the_command_prints_ep_beside_pp(k2, capsys):
    argv = ("--preset", "k2", "--devices", "16xH200", "--hosts", "2", "--parallel", "ep", "--batch", "64")
    run_plan(*argv, "--json")
    info = json.loads(capsys.readouterr().out)
    pp = plan(k2, "16xH200", hosts=2, batch=64)
    compared = info["pp_vs_ep"]
    assert compared["pp"]["decode_ms_per_token"] == pytest.approx(pp["decode_ms_per_token"])
    assert compared["pp"]["tokens_per_s"] == pytest.approx(pp["tokens_per_s"])  # 64 sequences fill 16 stages
    assert compared["ep"]["decode_ms_per_token"] == info["decode_ms_per_token"]
    # the trade-off: ep answers each token sooner; the pipeline's bound on throughput is higher at this batch
    assert compared["ep"]["decode_ms_per_token"] < compared["pp"]["decode_ms_per_token"] / 10
    assert compared["pp"]["tokens_per_s"] > compared["ep"]["tokens_per_s"]
    run_plan(*argv)
    table = capsys.readouterr().out
    ep_line = next(line for line in table.splitlines() if line.strip().startswith("ep (experts sharded)"))
    assert ep_line.split()[-2:] == [f"{info['decode_ms_per_token']:.2f}", f"{info['tokens_per_s']:,.0f}"]
    assert f"{info['all_to_all']['bytes_per_token_per_moe_layer']:,.0f} bytes per token per MoE layer" in table


def test_devices_that_cannot_hold_the_replicated_part_say_what_would(k2, capsys):
    with pytest.raises(K2Error) as caught:
        run_plan("--preset", "k2", "--devices", "16x16GB@1TB/s", "--parallel", "ep", "--context", "4096",
                 "--link", "100GB/s")
    message = str(caught.value)
    assert "\n" not in message and message.startswith("--parallel ep on 16 x 16GB@1TB/s: each device needs ")
    assert "replicated 14.24 GB" in message and "more than the 14.40 GB one may hold" in message
    assert "so no count of 16GB@1TB/s holds it: devices of at least " in message


def test_too_few_devices_for_the_experts_say_how_many_would(k2):
    with pytest.raises(K2Error, match=r"--parallel ep on 16 x H100: .* more than the 72\.00 GB one may hold; "
                                      r"it fits on 21 x H100; --parallel pp fits on 16xH100"):
        expert_parallel(k2, "16xH100")
    assert expert_parallel(k2, "21xH100")["per_device"]["experts_per_moe_layer"] == 19  # ceil(384 / 21)


@pytest.mark.parametrize("argv, problem", [
    (["--devices", "16xH200", "--placement", "0:61@cuda:0"], "--placement places layer ranges for --parallel pp"),
    (["--devices", "2x512GB@1TB/s"], "give --link, the bandwidth from one device to another in a host"),
    (["--devices", "16xH200", "--link", "fast"], "--link fast: expected a bandwidth such as 450GB/s"),
    (["--devices", "16xH200", "--inter-host", "0GB/s"], "--inter-host 0GB/s: expected a bandwidth"),
])
def test_ep_refuses_bad_input(argv, problem):
    with pytest.raises(K2Error, match=problem):
        run_plan("--preset", "tiny", "--parallel", "ep", "--context", "100", *argv)
