"""``python -m labs.bench``: see ``labs.bench``. The process ends without the interpreter's teardown
(``labs.runtime.exit``): about a second of CPU saved with torch loaded."""

from labs.bench import main
from labs.runtime.exit import exit_without_teardown

exit_without_teardown(main())
