from greet import greet

assert greet() == "hello", greet()
print("ok")
