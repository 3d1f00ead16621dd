"""A small MCP server for the agent tests, on the official `mcp` package's FastMCP.

    python mcp_server.py stdio            # MCP over stdin/stdout
    python mcp_server.py http PORT        # streamable HTTP on 127.0.0.1:PORT/mcp
"""

import asyncio
import sys

from mcp.server.fastmcp import FastMCP

port = int(sys.argv[2]) if len(sys.argv) > 2 else 8000
server = FastMCP("kimi-agent-test", host="127.0.0.1", port=port)


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def shout(text: str) -> str:
    """The text in capital letters."""
    return text.upper()


@server.tool()
def fail(reason: str) -> str:
    """Always fails with the given reason."""
    raise ValueError(f"failed on purpose: {reason}")


@server.tool()
async def nap(seconds: float) -> str:
    """Sleeps, then says so."""
    await asyncio.sleep(seconds)
    return "awake"


@server.tool()
def crash() -> str:
    """Exits the server process."""
    sys.stdout.flush()
    import os
    os._exit(3)


if __name__ == "__main__":
    server.run(transport="stdio" if sys.argv[1] == "stdio" else "streamable-http")
