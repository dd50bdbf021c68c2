"""`python -m minagent`: the demo, a model that cannot add given a calculator
(tasks/calculator/demo.py).

The package's front door, not part of the engine: the one module directly in minagent/ that
imports an application.
"""

from minagent.tasks.calculator import demo

demo.main()
