"""What a verdict becomes: the report, the JSON, the drain plan and --metrics, the --html page, the
--drain calls, and --verify-log (automation's reading of a saved log)."""
