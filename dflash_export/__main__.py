from dflash_export.cli import main

if __name__ == "__main__":
    main()
