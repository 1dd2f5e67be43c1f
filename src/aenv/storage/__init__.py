"""Storage seams (the repository and runtime resolver protocols), local runtime files, disk layers."""
