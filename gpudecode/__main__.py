from gpudecode.cli import main

main()
