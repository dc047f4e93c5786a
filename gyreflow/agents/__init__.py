"""Tasks and graders, the native agent loop, and (later) external agents behind the proxy."""
