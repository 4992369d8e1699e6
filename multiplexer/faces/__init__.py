"""Ways in: HTTP /rpc, the jobs.* methods, and MCP (HTTP and stdio); each turns requests into calls."""
