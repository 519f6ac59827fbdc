-- The runtime API of tool files: the modules a tool file may `require`, and the names it
-- sees of each (a read-only copy holding only these). Nothing else is reachable from a
-- tool: not the engine adapter, not the raw core.* bindings, not a module's internals.
-- docs/reference/runtime-api.md documents every name; tests/lua/runtime_api_test.lua fails
-- when the two disagree.
return {
  ["demesne.sandbox"] = { "run_script", "create", "exec", "upload", "download", "destroy", "list", "expose", "snapshot",
    "snapshots", "snapshot_delete", "fork", "pause", "resume" },
  ["demesne.jobs"] = { "dispatch", "get", "must_get", "wait", "cancel", "list", "view", "is_terminal",
    "read_stdout", "stdout_tail", "collect", "STATUSES" },
  ["demesne.agent"] = { "run", "text", "model_schema", "chain" },
  ["demesne.schemas"] = { "string_list", "files", "directories", "image", "env", "egress", "timeout_seconds",
    "limits", "sandbox_id", "run_result", "run_text", "background", "or_job", "job_id", "job_status",
    "job_properties", "status_result", "status_text", "agent_task", "agent_result", "AGENT_RUN_NOTE", "budget_usd",
    "tree", "mcp", "isolation", "host_mcp", "port", "previews", "sandbox_state_tool" },
  ["demesne.paths"] = { "check", "describe_roots" },
  ["demesne.progress"] = { "heartbeat" },
  ["demesne.config"] = { "get" },
  ["demesne.errors"] = { "new", "is", "raise", "check" },
  ["demesne.json"] = { "encode", "decode", "array", "is_array", "null" },
  ["demesne.async"] = { "sleep", "spawn", "timeout", "event", "cancel", "current", "CANCELLED" },
  ["demesne.log"] = { "log", "debug", "info", "notice", "warning", "error", "critical", "alert", "emergency" },
  ["demesne.tools"] = { "fail" },
  ["demesne.tree"] = { "report" },
  ["demesne.repo"] = { "params", "text", "SCHEMA" },
}
