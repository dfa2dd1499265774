"""The agent: runs tasks on a machine (a real process agent and simulated agents for scale)."""
