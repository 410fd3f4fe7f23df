"""Where records are compared and judged: alignment and comparison of two dumps, `diff`,
watchpoints (live and offline), `check`, the first NaN's origin and the flight recorder."""
