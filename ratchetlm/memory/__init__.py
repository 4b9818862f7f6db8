"""The process's memory as the operating system sees it: huge-page backed arrays, the memory left on the host."""
