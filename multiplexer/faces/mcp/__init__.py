"""The MCP face: one server for Streamable HTTP and stdio, tools from the routing table."""
