"""Mode 3 on Inductor: shape dispatch, disk cache (warm start in a second process, key, corrupt
artifacts, concurrent writers), debug dumps. One cold compile is shared by the package."""
