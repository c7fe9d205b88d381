"""The ``MLX_SPEC_PLUGIN=1`` switch: ``mlx_spec_plugin.pth`` read at start-up
as Python reads site-packages (``site.addsitedir`` on a folder holding the
shipped file, from a ``sitecustomize`` on PYTHONPATH: the test's own
environment is left as it is), then ``python -m mlx_lm generate`` as a user
types it, or a script that imports mlx_lm.

Off (unset, ``0``, a bad value), mlx-lm's functions are its own and nothing
of mlx-spec is even imported; on, nothing heavy is imported until the
program imports mlx_lm, and then its generate command prints what it
prints without the plugin while speculating."""

import ast
import os
import pathlib
import shutil
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from mlx_spec.plugin import __main__ as command
from mlx_spec.testing.plugin_commands import PROMPT, generate_args
from mlx_spec.testing.server import completion, free_port, running_server

ROOT = pathlib.Path(__file__).resolve().parents[2]

ROUTES = (
    # mlx_lm.generate is also a function's name: the module from sys.modules
    "import sys, mlx_lm; g, u = sys.modules['mlx_lm.generate'], sys.modules['mlx_lm.utils']; "
    "print(mlx_lm.stream_generate is g.stream_generate, "
    "g.stream_generate.__module__, mlx_lm.load is u.load)"
)


OPTIONS = ("MLX_SPEC_PLUGIN", "MLX_SPEC_DRAFT", "MLX_SPEC_NUM_DRAFT_TOKENS")


@pytest.fixture
def site_dir(tmp_path):
    """A folder for PYTHONPATH whose sitecustomize (run by site at every
    start) reads a site folder holding the shipped file."""
    folder, startup = tmp_path / "site", tmp_path / "startup"
    folder.mkdir()
    startup.mkdir()
    shutil.copy(ROOT / command.PTH_NAME, folder)
    (startup / "sitecustomize.py").write_text(
        f"import site\nsite.addsitedir({str(folder)!r})\n"
    )
    return startup


def python(site_dir, *argv, switch=None, extra_env=None, timeout=300):
    env = {k: v for k, v in os.environ.items() if k not in OPTIONS}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(site_dir)] + [p for p in [os.environ.get("PYTHONPATH")] if p]
    )
    if switch is not None:
        env["MLX_SPEC_PLUGIN"] = switch
    env.update(extra_env or {})
    return subprocess.run(
        [sys.executable, *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def test_the_shipped_file_is_the_line_the_command_writes():
    shipped = (ROOT / command.PTH_NAME).read_text()
    assert shipped == command.PTH_LINE
    assert shipped.startswith("import ") and shipped.count("\n") == 1


def test_the_hook_imports_only_the_standard_library_at_start_up():
    """mlx, mlx-lm and mlx-spec only inside functions (run once mlx_lm is
    imported); mlx and mlx-lm never."""
    tree = ast.parse((ROOT / "_mlx_spec_hook.py").read_text())
    top = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            top.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            top.add(node.module.split(".")[0])
    assert top <= set(sys.stdlib_module_names), top
    every = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            every.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            every.add(node.module.split(".")[0])
    assert not every & {"mlx", "mlx_lm"}, every


@pytest.mark.parametrize("switch", [None, "", "0"])
def test_off_mlx_lm_is_untouched_and_mlx_spec_never_imported(site_dir, switch):
    result = python(
        site_dir,
        "-c",
        ROUTES + "; print(sorted(m for m in sys.modules "
        "if m.split('.')[0] in ('mlx_spec', '_mlx_spec_hook')))",
        switch=switch,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["True mlx_lm.generate True", "[]"]
    assert result.stderr == ""


def test_on_nothing_is_imported_before_mlx_lm(site_dir):
    result = python(
        site_dir,
        "-c",
        "import sys; print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('mlx', 'mlx_lm', 'mlx_spec'))); " + ROUTES,
        switch="1",
    )
    assert result.returncode == 0, result.stderr
    # routed: stream_generate is the plugin's in both modules, load in mlx_lm
    # but not in mlx_lm.utils (convert and fuse load from there)
    assert result.stdout.splitlines() == ["[]", "True mlx_spec.plugin False"]


def test_on_a_program_that_imports_mlx_spec_first_is_routed(site_dir):
    """mlx_spec's own import brings mlx-lm in: the plugin waits for mlx_spec
    to finish importing before it enables."""
    code = "import mlx_spec; import mlx_lm; print(mlx_lm.stream_generate.__module__)"
    result = python(site_dir, "-c", code, switch="1")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "mlx_spec.plugin"


@pytest.mark.parametrize(
    "switch, extra, said",
    [
        ("yes", {}, "must be 1 (on) or 0 (off), got 'yes'"),
        ("1", {"MLX_SPEC_NUM_DRAFT_TOKENS": "many"}, "MLX_SPEC_NUM_DRAFT_TOKENS"),
        ("1", {"MLX_SPEC_DRAFT": "no-such-drafter"}, "not enabled: ValueError"),
    ],
)
def test_a_bad_value_is_one_line_and_the_program_runs_on(site_dir, switch, extra, said):
    result = python(site_dir, "-c", ROUTES, switch=switch, extra_env=extra)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True mlx_lm.generate True"
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and said in lines[0], result.stderr
    assert lines[0].startswith("mlx_spec.plugin (MLX_SPEC_PLUGIN): ")


def generate_command(model):
    return ("-m", "mlx_lm", "generate", *generate_args(model))


# qwen3_5_moe too: mlx-lm runs the tiny checkpoint's float32 experts on the
# CPU (a half-precision one, like the demo model's, it cannot: GatherMM).
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_mlx_lms_generate_command_speculates_with_the_switch(
    checkpoint_dirs, site_dir, family
):
    """``python -m mlx_lm generate`` as run by a user: same stdout, and the
    line at exit says the call was speculated on."""
    args = generate_command(checkpoint_dirs[family])
    plain = python(site_dir, *args)
    assert plain.returncode == 0, plain.stderr
    spec = python(site_dir, *args, switch="1")
    assert spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout and plain.stdout.strip()
    assert "mlx_spec.plugin: 1 call(s) speculated;" in spec.stderr
    assert "mlx_spec.plugin" not in plain.stderr


def test_a_program_that_never_generates_prints_nothing(site_dir):
    result = python(site_dir, "-c", "import mlx_lm", switch="1")
    assert result.returncode == 0 and result.stderr == "" and result.stdout == ""


def test_install_and_remove_hook_touch_only_their_own_file(tmp_path, monkeypatch):
    path = tmp_path / command.PTH_NAME
    monkeypatch.setattr(command, "_hook_path", lambda: str(path))
    assert command.remove_hook() == 0 and not path.exists()
    assert command.install_hook() == 0
    assert path.read_text() == command.PTH_LINE
    assert command.install_hook() == 0  # again: unchanged
    assert command.remove_hook() == 0 and not path.exists()
    path.write_text("import something_else\n")  # another's file of that name
    assert command.install_hook() == 1 and command.remove_hook() == 1
    assert path.read_text() == "import something_else\n"


def test_the_hook_commands_are_in_the_usage():
    assert "--install-hook" in command.USAGE and "--remove-hook" in command.USAGE


def test_the_build_puts_the_file_at_the_wheels_root(tmp_path):
    """setup.py's build_py: what a wheel carries to site-packages (the
    wheel's root) holds the start-up file and the hook module. (A real
    wheel needs the build backend from the network; this is its step.)"""
    build, egg = tmp_path / "build", tmp_path / "egg"
    egg.mkdir()
    result = subprocess.run(
        [sys.executable, "setup.py", "-q", "egg_info", "-e", str(egg)]
        + ["build_py", "-d", str(build)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert (build / command.PTH_NAME).read_text() == command.PTH_LINE
    assert (build / "_mlx_spec_hook.py").is_file()
    assert (build / "mlx_spec" / "plugin" / "__init__.py").is_file()


@pytest.mark.slow
def test_mlx_lms_server_speculates_with_the_switch(
    checkpoint_dirs, site_dir, tmp_path, monkeypatch
):
    """``python -m mlx_lm server``: the same greedy completions with the
    switch as without, one after the other and two at once; stopped by
    Ctrl-C (SIGINT, which mlx-lm's server handles), it reports every
    request speculated on."""
    monkeypatch.setenv(
        "PYTHONPATH",
        os.pathsep.join(
            [str(site_dir)] + [p for p in [os.environ.get("PYTHONPATH")] if p]
        ),
    )
    for name in OPTIONS:
        monkeypatch.delenv(name, raising=False)
    model = str(checkpoint_dirs["qwen3_next"])
    prompts = [PROMPT, PROMPT + " sat on"]
    answers = {}
    for name in ("plain", "switch"):
        if name == "switch":
            monkeypatch.setenv("MLX_SPEC_PLUGIN", "1")
        port = free_port()
        log = tmp_path / f"{name}.log"
        command = [sys.executable, "-m", "mlx_lm", "server", "--model", model]
        with running_server(
            command + ["--port", str(port)], port, log=str(log)
        ) as proc:
            one_by_one = [completion(port, p) for p in prompts]
            with ThreadPoolExecutor(len(prompts)) as pool:
                together = list(pool.map(lambda p: completion(port, p), prompts))
            answers[name] = one_by_one, together
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
    assert answers["switch"] == answers["plain"]
    one_by_one, together = answers["plain"]
    assert all(one_by_one) and together == one_by_one
    assert (
        "mlx_spec.plugin: 4 call(s) speculated;"
        in (tmp_path / "switch.log").read_text()
    )
    assert "mlx_spec.plugin" not in (tmp_path / "plain.log").read_text()
