"""TensorBoard output read back with TensorBoard's own reader: the run's config in the Text and HParams
panels, and the collapse alarm's rule; the throughput meter and its model-FLOPs count."""
from __future__ import annotations

import itertools
import types

import pytest
import torch

from clsys.recipes import load_config
from clsys.metrics.health import TensorBoard, collapsed


def test_config_in_the_text_and_hparams_panels(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    cfg = load_config("quickstart", ["train.steps=7", "deepspeed.wall_clock_breakdown=true"])
    tb = TensorBoard(str(tmp_path))
    tb.config(cfg, "stsb-en-dev_spearman")
    tb.scalars("eval", {"stsb-en-dev_spearman": 80.0}, 7)
    tb.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert list(tmp_path.iterdir()) == [next(tmp_path.glob("events.out.tfevents.*"))], "one run folder, no subfolder"
    text = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert text.startswith("```yaml\n") and "  steps: 7\n" in text and "wall_clock_breakdown: true" in text
    content = events.PluginTagToContent("hparams")
    start = HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info
    assert start.hparams["train.steps"].number_value == 7
    assert start.hparams["optim.lr"].number_value == pytest.approx(6e-5)
    assert start.hparams["model.name"].string_value == "all-MiniLM-L6-v2"
    assert start.hparams["deepspeed.wall_clock_breakdown"].number_value == 1  # torch writes bools as numbers
    experiment = HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    assert [m.name.tag for m in experiment.metric_infos] == ["eval/stsb-en-dev_spearman"]


def test_collapse_rule():
    assert collapsed({"uniformity": -0.05}, -0.2)
    assert not collapsed({"uniformity": -3.7}, -0.2)  # the quickstart's healthy values: about -3 to -3.8
    assert not collapsed({"uniformity": -0.05}, 0.0)  # 0: off
    assert not collapsed({"loss": 1.0}, -0.2)  # objectives that log no uniformity


def test_encoder_train_flops_match_torch_flop_counter():
    """The MFU numerator against torch's own FLOP counter on a real BERT forward + backward (rows of
    equal length: the counter sees padding as work, the formula does not)."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import BertConfig, BertModel

    from clsys.metrics.health import encoder_train_flops

    config = BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                        intermediate_size=256, max_position_embeddings=64, attn_implementation="sdpa")
    model = BertModel(config, add_pooling_layer=False)
    ids = torch.randint(0, 100, (5, 24))
    counter = FlopCounterMode(display=False)
    with counter:
        model(input_ids=ids).last_hidden_state.sum().backward()
    expected = counter.get_total_flops()
    got = float(encoder_train_flops(config, torch.ones(5, 24, dtype=torch.long)))
    assert got == pytest.approx(expected, rel=1e-6)
    # Padding is not counted: two rows of 10 and 24 tokens cost what those rows cost alone.
    mask = torch.zeros(2, 24, dtype=torch.long)
    mask[0, :10], mask[1] = 1, 1
    one = lambda n: float(encoder_train_flops(config, torch.ones(1, n, dtype=torch.long)))  # noqa: E731
    assert float(encoder_train_flops(config, mask)) == pytest.approx(one(10) + one(24))


def test_throughput_reports_per_device_rates_tflops_and_mfu(monkeypatch):
    from clsys.metrics import health as metrics
    from clsys.metrics.health import Throughput, peak_tflops

    clock = itertools.chain([100.0], itertools.repeat(102.0))  # the meter starts at 100 s, rates() at 102 s
    monkeypatch.setattr(metrics, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    meter = Throughput(peak_tflops=4.0)
    meter.add(8, torch.tensor(300), {"loader_wait": 0.5}, torch.tensor(6e12, dtype=torch.float64))
    meter.add(8, torch.tensor(100), {}, torch.tensor(2e12, dtype=torch.float64))
    rates = meter.rates()
    assert rates["tokens_per_s_per_device"] == rates["tokens_per_s"] == 200.0
    assert rates["model_tflops_per_device"] == pytest.approx(4.0) and rates["mfu"] == pytest.approx(1.0)
    assert (rates["samples_per_s"], rates["step_time_s"], rates["loader_wait_fraction"]) == (8.0, 1.0, 0.25)
    # The peak: the configured one first; none on a CPU (no data sheet to read it from).
    assert peak_tflops(123.0, use_gpu=False, precision="fp32") == 123.0
    assert peak_tflops(0.0, use_gpu=False, precision="bf16") == 0.0
