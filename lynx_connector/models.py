"""placeholder: replaced below"""
import sys
if __name__ == "__main__":
    sys.exit(0)
