"""TensorBoard output read back with TensorBoard's own reader: the run's config in the Text and HParams
panels, and the collapse alarm's rule."""
from __future__ import annotations

import pytest

from clsys.config import load_config
from clsys.metrics import TensorBoard, collapsed


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
