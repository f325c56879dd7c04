"""Getting into SGLang without patching it: the plugin entry point, its hooks (wiring) and the opt-in CPU platform."""
