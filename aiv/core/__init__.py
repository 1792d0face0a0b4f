"""The floor every mode stands on (the preflight, the node gate, the screen): the tool's names and exit
codes, findings, hostlists, the blame law and its gate, the one table of deadlines and the bounds that
enforce it, atomic files and locks."""
