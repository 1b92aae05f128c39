"""kern.kern_toml: targets, defaults, byte sizes, and errors that name key and file."""

from __future__ import annotations

import pytest

from kern.kern_toml import DEFAULT_THREADS, TomlConfigError, load_toml_config


def write(tmp_path, text: str):
    path = tmp_path / "kern.toml"
    path.write_text(text)
    return path


def test_full_target(tmp_path):
    path = write(
        tmp_path,
        """
[targets.big]
checkpoint = "models/qwen"
dtype = "bfloat16"
device = "cuda:1"
pool_bytes = "1.5GiB"
host_bytes = 1000
page_tokens = 32
rows = [4, 1, 4]
draft = "ngram"
ranks = 2
threads = 1

[targets.small]
checkpoint = "/abs/tiny"
rows = 3
draft = "drafts/tiny"
""",
    )
    config = load_toml_config(path)
    big, small = config.target("big"), config.target("small")
    assert big.checkpoint == (tmp_path / "models/qwen").resolve()
    assert (big.dtype, big.device, big.page_tokens, big.ranks, big.threads) == (
        "bfloat16",
        "cuda:1",
        32,
        2,
        1,
    )
    assert big.pool_bytes == 3 * 2**29 and big.host_bytes == 1000
    assert big.rows == (1, 4) and big.widest_rows == 4 and big.draft == "ngram"
    assert small.checkpoint.as_posix() == "/abs/tiny"
    assert small.rows == (3,) and small.draft == str((tmp_path / "drafts/tiny").resolve())
    assert (small.dtype, small.device, small.threads) == ("float32", "cpu", DEFAULT_THREADS)
    assert small.pool_bytes is None and small.host_bytes == 0 and small.page_tokens == 16


def test_cuda_defaults_to_bfloat16(tmp_path):
    path = write(tmp_path, '[targets.g]\ncheckpoint = "c"\ndevice = "cuda"\n')
    assert load_toml_config(path).target("g").dtype == "bfloat16"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('[targets.a]\ncheckpoint = "c"\npage_token = 8\n', "targets.a: unknown key 'page_token'"),
        ("[server]\nport = 1\n", "unknown key 'server'"),
        ("[targets.a]\ndtype = 'float32'\n", "targets.a: missing key 'checkpoint'"),
        ('[targets.a]\ncheckpoint = "c"\ndtype = "int8"\n', "targets.a.dtype: 'int8'"),
        ('[targets.a]\ncheckpoint = "c"\ndevice = "tpu"\n', "targets.a.device: 'tpu'"),
        ('[targets.a]\ncheckpoint = "c"\nrows = [0]\n', "targets.a.rows"),
        ('[targets.a]\ncheckpoint = "c"\ndraft = "ngram"\n', "targets.a.draft: draft = 'ngram' dr"),
        ('[targets.a]\ncheckpoint = "c"\ndraft = 3\nrows = [1, 2]\n', "targets.a.draft: expected"),
        ('[targets.a]\ncheckpoint = "c"\nrows = []\n', "targets.a.rows"),
        ('[targets.a]\ncheckpoint = "c"\nthreads = true\n', "targets.a.threads"),
        ('[targets.a]\ncheckpoint = "c"\npool_bytes = "lots"\n', "targets.a.pool_bytes"),
        ('[targets.a]\ncheckpoint = "c"\npool_bytes = 0\n', "must be at least 1"),
        ("[targets.a]\ncheckpoint = 3\n", "targets.a.checkpoint: expected a string"),
        ("targets = 3\n", "'targets' must be tables"),
        ("[targets\n", "not valid TOML"),
        (
            '[targets.a]\ncheckpoint = "c"\nallow_unknown_fields = 1\n',
            "targets.a.allow_unknown_fields: expected true or false",
        ),
        (
            '[targets.a]\ncheckpoint = "c"\nhosted_tools = "run"\n',
            "targets.a.hosted_tools: 'run' is not one of refuse, drop",
        ),
    ],
)
def test_errors_name_the_file_and_key(tmp_path, body, message):
    path = write(tmp_path, body)
    with pytest.raises(TomlConfigError) as e:
        load_toml_config(path)
    assert str(e.value).startswith(f"{path}: ") and message in str(e.value)


def test_unknown_target_names_the_known_ones(tmp_path):
    config = load_toml_config(write(tmp_path, '[targets.a]\ncheckpoint = "c"\n'))
    with pytest.raises(TomlConfigError, match=r"no target 'b' \(targets: a\)"):
        config.target("b")


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_toml_config(tmp_path / "nope.toml")


def test_agent_keys(tmp_path):
    body = '[targets.a]\ncheckpoint = "c"\nallow_unknown_fields = true\nhosted_tools = "drop"\n'
    target = load_toml_config(write(tmp_path, body)).target("a")
    assert target.allow_unknown_fields is True and target.hosted_tools == "drop"
    plain = load_toml_config(write(tmp_path, '[targets.a]\ncheckpoint = "c"\n')).target("a")
    assert plain.allow_unknown_fields is False and plain.hosted_tools == "refuse"
