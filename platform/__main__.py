from raylane.cli import main

main()
