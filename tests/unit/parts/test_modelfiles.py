"""Which model files a resident unit loads, from its ExecStart= and Environment=."""

from __future__ import annotations

from gpuswapd.adapters.unitstates import Commands
from gpuswapd.parts.modelfiles import model_files, split_parts


def found(*argvs: tuple[str, ...], env: tuple[str, ...] = (), cwd: str = "") -> tuple[list[str], list[str]]:
    f = model_files(Commands("strata.service", argvs, env, cwd))
    return f.paths, f.unresolved


def test_llama_servers_own_options_name_its_files() -> None:
    paths, unresolved = found(("/usr/bin/llama-server", "-m", "/models/a.gguf", "--mmproj", "/models/p.gguf",
                               "-md", "/models/d.gguf", "--port", "8081"))
    assert paths == ["/models/a.gguf", "/models/p.gguf", "/models/d.gguf"] and unresolved == []
    assert found(("/usr/bin/llama-server", "--model=/m/a.gguf", "--model-draft=/m/d.gguf", "--mmproj=/m/p.gguf"))[0] \
        == ["/m/a.gguf", "/m/d.gguf", "/m/p.gguf"]


def test_a_wrapper_and_a_shell_command_line_are_read_too() -> None:
    wrapper = ("/usr/bin/python3", "/opt/gpu_hold.py", "--bytes", "21GiB", "--", "/opt/llama-server", "-m",
               "/srv/strata.gguf", "--alias", "strata")
    assert found(wrapper)[0] == ["/srv/strata.gguf"]
    shell = ("/bin/sh", "-c", "exec /opt/llama-server --model '/srv/my model.gguf' -c 8192")
    assert found(shell)[0] == ["/srv/my model.gguf"]


def test_environment_and_variables_come_from_the_unit() -> None:
    env = ("MODELS=/srv/models", "LLAMA_ARG_MODEL=/srv/models/env.gguf", "LLAMA_ARG_MMPROJ=${MODELS}/p.gguf")
    paths, unresolved = found(("/opt/llama-server", "-md", "$MODELS/draft.gguf"), env=env)
    assert paths == ["/srv/models/draft.gguf", "/srv/models/env.gguf", "/srv/models/p.gguf"] and unresolved == []


def test_relative_paths_are_taken_from_the_working_directory() -> None:
    assert found(("/opt/llama-server", "-m", "models/a.gguf"), cwd="/srv")[0] == ["/srv/models/a.gguf"]
    assert found(("/opt/llama-server", "-m", "a.gguf"), cwd="!/srv")[0] == ["/srv/a.gguf"]
    assert found(("/opt/llama-server", "-m", "a.gguf"))[0] == ["/a.gguf"]  # a system service runs in /
    paths, unresolved = found(("/opt/llama-server", "-m", "a.gguf"), cwd="~")
    assert paths == [] and "a path relative to a home directory" in unresolved[0]


def test_downloaded_models_and_unknown_variables_are_reported_not_guessed() -> None:
    paths, unresolved = found(("/opt/llama-server", "-hf", "org/model-GGUF", "--hf-file=q4.gguf", "-m", "$NOPE"),
                              env=("LLAMA_ARG_HF_REPO=org/other",))
    assert paths == []
    assert unresolved == [
        "strata.service: -hf 'org/model-GGUF': llama.cpp downloads that model into its own cache",
        "strata.service: --hf-file 'q4.gguf': llama.cpp downloads that model into its own cache",
        "strata.service: -m '$NOPE': cannot tell which file that is (a variable the unit does not set, or a "
        "path relative to a home directory)",
        "strata.service: Environment=LLAMA_ARG_HF_REPO='org/other': llama.cpp downloads that model into its own "
        "cache",
    ]


def test_a_split_gguf_names_every_part_and_each_file_counts_once() -> None:
    assert split_parts("/m/big-00002-of-00003.gguf") == ["/m/big-00001-of-00003.gguf", "/m/big-00002-of-00003.gguf",
                                                         "/m/big-00003-of-00003.gguf"]
    paths, _ = found(("/opt/llama-server", "-m", "/m/big-00001-of-00002.gguf"),
                     ("/opt/llama-server", "-m", "/m/big-00002-of-00002.gguf"), env=("LLAMA_ARG_MODEL=/m/a.gguf",))
    assert paths == ["/m/big-00001-of-00002.gguf", "/m/big-00002-of-00002.gguf", "/m/a.gguf"]


def test_a_unit_that_runs_no_model_names_nothing() -> None:
    assert found(("/usr/bin/llama-swap", "--config", "/etc/llama-swap.yaml", "--listen", ":8080")) == ([], [])
    assert found() == ([], [])
    assert found(("/opt/llama-server", "-m")) == ([], [])  # no value: nothing to take


def test_m_is_a_model_only_as_llama_servers_option_not_pythons() -> None:
    assert found(("/usr/bin/python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m/x")) == ([], [])
    assert found(("/usr/bin/python3", "-m", "wrapper", "--", "/opt/llama-server", "-m", "/m/a.gguf"))[0] == \
        ["/m/a.gguf"]
    assert found(("/bin/sh", "-c", "python -m http.server; exec llama-server -m /m/b.gguf"))[0] == ["/m/b.gguf"]
