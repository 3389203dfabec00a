import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from pipelinerl.metrics import Scalars, TokenStats, read_token_stats


def test_scalars_and_histograms_are_readable_by_tensorboard(tmp_path):
    tb = Scalars(tmp_path, "trainer")
    for step in range(3):
        tb.log(step, {"loss": 1.0 / (step + 1), "lr": 1e-4})
        tb.histogram(step, "lag/hist", np.array([0, 1, 1, step]))
    tb.close()
    acc = EventAccumulator(str(tmp_path / "tb" / "trainer"), size_guidance={"histograms": 0})
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"loss", "lr"}
    loss = acc.Scalars("loss")
    assert [e.step for e in loss] == [0, 1, 2]
    np.testing.assert_allclose([e.value for e in loss], [1.0, 0.5, 1 / 3], rtol=1e-6)
    hist = acc.Histograms("lag/hist")
    assert hist[2].histogram_value.num == 4 and hist[2].histogram_value.max == 2


def test_token_stats_append_reopen_and_truncate_for_resume(tmp_path):
    stats = TokenStats(tmp_path)
    rng = np.random.default_rng(0)
    expected = {"step": [], "lag": [], "behaviour_logprobs": [], "current_logprobs": []}
    for step in range(4):
        n = int(rng.integers(1, 50))
        lag, b, c = rng.integers(0, 3, n), rng.normal(size=n), rng.normal(size=n)
        stats.append(step, lag, b, c)
        for name, v in (("step", np.full(n, step)), ("lag", lag), ("behaviour_logprobs", b),
                        ("current_logprobs", c)):
            expected[name].append(v)
    again = TokenStats(tmp_path)  # a restarted trainer reopens the arrays
    assert len(again) == sum(len(v) for v in expected["lag"])
    again.truncate_to_step(2)  # resumed from the checkpoint taken after step 1
    got = read_token_stats(tmp_path)
    for name, parts in expected.items():
        np.testing.assert_allclose(got[name], np.concatenate(parts[:2]).astype(got[name].dtype))
