"""The microkernel's layering, read from the sources: the core imports no plugin or server code,
nothing imports a private name of another package, and no modules import each other in a cycle
(function-level imports included: a cycle there is a design knot even when Python copes)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parent.parent
PACKAGES = {  # import name -> its folder
    "speculant": "core/speculant",
    "speculant_server": "server/speculant_server",
    "speculant_cpu": "plugins/backend_cpu/speculant_cpu",
    "speculant_transformer": "plugins/transformer/speculant_transformer",
    "speculant_ngram": "plugins/ngram/speculant_ngram",
    "speculant_draft": "plugins/draft/speculant_draft",
    "speculant_eagle3": "plugins/eagle3/speculant_eagle3",
    "speculant_mtp": "plugins/mtp/speculant_mtp",
    "speculant_dflash": "plugins/dflash/speculant_dflash",
    "speculant_suffix": "contrib/speculant-suffix/speculant_suffix",
    "vllm_speculant": "contrib/vllm-speculant/vllm_speculant",
}


def modules() -> dict[str, Path]:
    out = {}
    for pkg, folder in PACKAGES.items():
        for f in (ROOT / folder).rglob("*.py"):
            parts = [pkg, *f.relative_to(ROOT / folder).with_suffix("").parts]
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names imported from it) for every absolute import in the file, at any depth."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out.extend((a.name, []) for a in node.names)
    return out


def test_the_core_imports_no_plugin_or_server_code():
    bad = [(m, mod) for m, f in modules().items() if m.split(".")[0] == "speculant"
           for mod, _ in imports(f) if mod.split(".")[0] in PACKAGES and mod.split(".")[0] != "speculant"]
    assert not bad, f"core modules importing plugin or server code: {bad}"


# The core's public modules (docs/plugins.md, "The core's public API"); the rest is internal.
PUBLIC_CORE = {"speculant", "speculant.gguf", "speculant.speculator", "speculant.engine", "speculant.sampling",
               "speculant.errors", "speculant.options", "speculant.flags", "speculant.logs", "speculant.plugins",
               "speculant.testing", "speculant.training", "speculant.drafting"}


def test_plugins_use_only_the_core_s_public_modules():
    bad = [(m, mod) for m, f in modules().items() if m.split(".")[0] != "speculant"
           for mod, _ in imports(f) if mod.split(".")[0] == "speculant" and mod not in PUBLIC_CORE
           and not mod.startswith("speculant.testing.")]
    assert not bad, f"plugins importing internal core modules: {bad}"


def test_no_package_imports_a_private_name_of_another():
    bad = []
    for m, f in modules().items():
        own = m.split(".")[0]
        for mod, names in imports(f):
            if mod.split(".")[0] in PACKAGES and mod.split(".")[0] != own:
                private = [p for p in mod.split(".") if p.startswith("_")] + [n for n in names if n.startswith("_")]
                if private:
                    bad.append((m, mod, private))
    assert not bad, f"imports of private names across packages: {bad}"


def test_no_import_cycles():
    mods = modules()
    graph = {}
    for m, f in mods.items():
        deps = set()
        for mod, names in imports(f):
            for target in [mod, *(f"{mod}.{n}" for n in names)]:
                # a module may use its own package's __init__ (Python runs it first anyway)
                if target in mods and target != m and not m.startswith(target + "."):
                    deps.add(target)
        graph[m] = deps
    cycles = []
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(m, path):
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append(path[path.index(d):] + [d])
            elif d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_cpu_backend_s_optional_kernels_match_the_declared_signatures():
    """Backend.BackendKernels fixes the optional kernels' names and parameters; a backend that
    has one takes the same parameters, and architectures look up only declared names."""
    import inspect

    from speculant.model import BACKEND_KERNELS, BackendKernels, backend_kernel
    from speculant_cpu.backend import CpuBackend

    assert {"batch", "row_classes", "rms_norm", "rope_tables", "apply_rope", "swiglu", "gelu_tanh"} <= set(BACKEND_KERNELS)
    backend = CpuBackend()
    for name in BACKEND_KERNELS:
        impl = backend_kernel(backend, name)
        if impl is None:
            continue
        declared = list(inspect.signature(getattr(BackendKernels, name)).parameters)[1:]  # without self
        assert list(inspect.signature(impl).parameters) == declared, name
    try:
        backend_kernel(backend, "not_a_kernel")
    except AttributeError:
        pass
    else:
        raise AssertionError("an undeclared kernel name must be refused")


def test_each_first_party_plugin_installs_alone():
    """Each plugin folder (and the server) is its own distribution: a pyproject.toml that
    depends on the core, declares the entry point the root declares for it, and packages a
    folder that imports no other plugin (so it installs with the core alone)."""
    import tomllib

    root = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["speculant"]
    for pkg, folder in PACKAGES.items():
        if pkg == "speculant" or folder.startswith("contrib/"):
            continue
        meta = tomllib.loads((ROOT / folder).parent.joinpath("pyproject.toml").read_text())
        project = meta["project"]
        assert any(d.startswith("speculant>=") for d in project["dependencies"]), f"{folder}: must depend on the core"
        eps = project["entry-points"]["speculant"]
        assert eps and all(root.get(name) == target for name, target in eps.items()), f"{folder}: entry points {eps} differ from the root's"
        assert meta["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"] == [pkg]
        others = [(m, mod) for m, f in modules().items() if m.split(".")[0] == pkg for mod, _ in imports(f)
                  if mod.split(".")[0] in PACKAGES and mod.split(".")[0] not in (pkg, "speculant")]
        assert not others, f"{pkg} imports another plugin, so it cannot install alone: {others}"
