-- sandbox_agent: an AI coding agent in a fresh sandbox (lua/agent.lua).
return require("demesne.agent").descriptor(false)
