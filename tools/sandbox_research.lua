-- sandbox_research: an AI agent with open egress and no host inputs (lua/agent.lua).
return require("demesne.agent").descriptor(true)
