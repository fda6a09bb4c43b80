"""The sampling controls of issue 30 in the Python client's requests and the CLI's flags."""

from __future__ import annotations

import pytest

from client.cli import build_parser, generate_options
from client.messages import generate_request


def test_generate_request_carries_the_sampling_controls() -> None:
    request = generate_request("hi", {"presence_penalty": 0.5, "frequency_penalty": -1.0, "repetition_penalty": 1.3,
                                      "logit_bias": {198: -100.0, 7: 2.5}, "min_tokens": 4, "min_p": 0.05})
    sampling = request.sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.min_tokens) == (0.5, -1.0, 4)
    assert sampling.HasField("repetition_penalty") and sampling.repetition_penalty == pytest.approx(1.3)
    assert dict(sampling.logit_bias) == {198: -100.0, 7: 2.5}
    assert sampling.min_p == pytest.approx(0.05)
    plain = generate_request("hi", {}).sampling
    assert not plain.HasField("repetition_penalty") and not plain.logit_bias and plain.min_tokens == 0


def test_cli_flags_become_options() -> None:
    args = build_parser().parse_args([
        "generate", "hi", "--presence-penalty", "0.5", "--frequency-penalty", "1", "--repetition-penalty", "1.2",
        "--logit-bias", "198=-100", "--logit-bias", "7=2.5", "--min-tokens", "3", "--min-p", "0.1"])
    prompt, options = generate_options(args, "hi")
    assert prompt == "hi"
    assert options["logit_bias"] == {198: -100.0, 7: 2.5}
    assert (options["presence_penalty"], options["frequency_penalty"], options["repetition_penalty"],
            options["min_tokens"], options["min_p"]) == (0.5, 1.0, 1.2, 3, 0.1)
    _, defaults = generate_options(build_parser().parse_args(["generate", "hi"]), "hi")
    assert not {"logit_bias", "presence_penalty", "repetition_penalty", "min_tokens", "min_p"} & set(defaults)


@pytest.mark.parametrize("bad", ["198", "x=1", "5=big"])
def test_bad_logit_bias_flag_is_a_usage_error(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["generate", "hi", "--logit-bias", bad])
    assert exit_.value.code == 2 and "ID=BIAS" in capsys.readouterr().err
