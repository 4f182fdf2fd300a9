"""The reproduction report (`ppd-bench report`): the paper's tables and figures from benchmark records."""
